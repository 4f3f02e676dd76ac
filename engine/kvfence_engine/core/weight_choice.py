"""`--weight-dtype auto` on CPU: which packing of the linears to serve, by measurement.

Where more than one packing serves a file's own weights (a GGUF with Q4_0/Q4_1 blocks: int4
keeps the blocks; int4+float16 keeps them and also holds their dequantization as float16, for
batches past a few rows; each up to a rounding finer than the 4-bit step), the fastest one
depends on the CPU, not on the file: aten's int4 kernel is fast on AVX-512 at a batch of one,
and on AVX2 runs at half of fbgemm's float16 GEMM at every batch size, which prefills and busy
decode steps feel (core/quantization.py). So the engine measures them at start, on the model
itself (every layer: what a step really reads from memory, not one layer that fits in cache),
in interleaved rounds so that load from outside falls on every candidate alike, and serves the
one that costs least. int4+float16 measures, once, where each shape of linear switches forms
(calibrate_switch).

The workload it weighs (WORKLOAD): requests of PROMPT_TOKENS prompt and NEW_TOKENS new tokens,
served alone (a decode batch of one) and CONCURRENCY at a time (a batch of CONCURRENCY); its
cost is one prefill per request plus NEW_TOKENS decode steps. A path's cost at each
concurrency is divided by the cheapest path's there, and the path whose worst such ratio is
least is served; the candidates come fewest bytes first, and one that holds more is taken
only if its worst ratio is MARGIN lower, so that timing noise does not flip the choice from
start to start where two are close.

With tensor parallelism every rank must run the same packing, so there the first candidate is
served unmeasured (the log says so).
"""

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from kvfence_engine.core.attention import StepBatch
from kvfence_engine.core.choice_cache import ChoiceCache
from kvfence_engine.core.decoder import Decoder
from kvfence_engine.core.quantization import (
    Int4Groups,
    Int4Linear,
    WeightDtype,
    int4_kernel,
    pack_int4_linears,
    pack_linears,
)

log = logging.getLogger(__name__)

PROMPT_TOKENS = 256
NEW_TOKENS = 256
CONCURRENCY = 16  # or --max-num-seqs, if fewer
MARGIN = 0.05
ROUNDS = 3  # interleaved: each candidate measured, then the next, this many times
# measured: a prefill this long (its cost scales with the tokens: compute-bound matmuls), and
# decode steps attending to this many positions
# a whole PROMPT_TOKENS prompt: a 64-token prefill hid what a long one costs (kvfence's int4
# kernel: 1.15x float16's at 64 tokens, 1.6x at 640 rows)
PREFILL_MEASURED = PROMPT_TOKENS
CONTEXT_MEASURED = 64


@dataclass(frozen=True, slots=True)
class StepTimes:
    """One packing's measured times, in milliseconds: a decode step of one row and of
    `rows` rows, and a prefill of PREFILL_MEASURED tokens."""

    decode_one: float
    decode_many: float
    rows: int
    prefill: float

    def request_cost(self, concurrency: int) -> float:
        """ms per request of the workload, served `concurrency` at a time."""
        step = self.decode_one if concurrency == 1 else self.decode_many / concurrency
        return self.prefill * PROMPT_TOKENS / PREFILL_MEASURED + NEW_TOKENS * step

    def fastest(self, other: "StepTimes") -> "StepTimes":
        """Each time, the lesser of the two measurements."""
        return StepTimes(
            min(self.decode_one, other.decode_one),
            min(self.decode_many, other.decode_many),
            self.rows,
            min(self.prefill, other.prefill),
        )

    def said(self) -> str:
        return (
            f"decode 1 row {self.decode_one:.1f} ms, {self.rows} rows {self.decode_many:.1f} "
            f"ms, prefill {PREFILL_MEASURED} tokens {self.prefill:.0f} ms"
        )


@dataclass(frozen=True, slots=True)
class WeightChoice:
    """The packing served and why: each candidate's times, and its worst cost against the
    cheapest at either concurrency."""

    chosen: WeightDtype
    times: dict[WeightDtype, StepTimes]
    worst: dict[WeightDtype, float]
    kept: str | None = None  # measured at an earlier start: when, and the file that kept it

    def reason(self) -> str:
        rows = next(iter(self.times.values())).rows
        each = "; ".join(
            f"{kind}: {t.said()} (worst {self.worst[kind]:.2f}x the fastest)"
            for kind, t in self.times.items()
        )
        cpu = torch.backends.cpu.get_cpu_capability()
        return (
            f"auto chose {self.chosen} by measurement on this CPU ({cpu}, "
            f"{torch.get_num_threads()} threads, int4 kernel {int4_kernel()}), for "
            f"{PROMPT_TOKENS}-token prompts and "
            f"{NEW_TOKENS} new tokens at concurrency 1 and {rows}: {each}"
            + ("" if self.kept is None else f" (measured {self.kept})")
        )


def choose(times: dict[WeightDtype, StepTimes], kept: str | None = None) -> WeightChoice:
    """The packing whose worst cost ratio to the fastest, over concurrency 1 and many, is
    least, where `times` lists them by the bytes they hold, fewest first: a packing that holds
    more is taken only if its worst ratio is MARGIN lower than the one it displaces. Pure."""
    kinds = list(times)
    concurrencies = (1, next(iter(times.values())).rows)
    best = {c: min(times[k].request_cost(c) for k in kinds) for c in concurrencies}
    worst = {k: max(times[k].request_cost(c) / best[c] for c in concurrencies) for k in kinds}
    chosen = kinds[0]
    for kind in kinds[1:]:
        if worst[kind] < worst[chosen] - MARGIN:
            chosen = kind
    return WeightChoice(chosen, dict(times), worst, kept)


Measure = Callable[[Decoder], StepTimes]


def choose_packing(
    model: Decoder,
    int4: dict[str, Int4Groups],
    candidates: Sequence[WeightDtype],
    measure: Measure,
    rounds: int = ROUNDS,
    cache: ChoiceCache | None = None,
) -> WeightChoice:
    """Time the model with its linears packed as each candidate, in `rounds` interleaved
    rounds (A, B, A, B, ...: load from outside, such as another engine starting on the same
    cores, falls on both alike), keep each candidate's fastest, and leave the model packed as
    the chosen one. `model` comes with its float nn.Linear layers. Each round packs anew: the
    model never holds two candidates at once (an engine pod's memory limit is sized for one);
    int4+float16 is one candidate of two forms, so its rounds are the peak: the float
    linears, the int4 blocks and the float16 packing (SmolLM2: ~60 MB more than float16's).
    With `cache`, a measurement it kept is used instead of measuring, and a new one kept."""
    recalled = None if cache is None else cache.load()
    if recalled is not None:
        times = {
            kind: StepTimes(t["decode_one"], t["decode_many"], int(t["rows"]), t["prefill"])
            for kind, t in recalled.times.items()
        }
        switches: Switches = dict(recalled.switches)
        choice = choose(times, kept=f"{recalled.measured_at}, kept in {recalled.path}")
        pack(model, choice.chosen, int4, switches)
        return choice
    originals = _linears(model)
    times = {}
    switches = {}  # int4+float16's, measured once
    for _ in range(rounds):
        for kind in candidates:
            pack(model, kind, int4, switches)
            timed = measure(model)
            times[kind] = timed if kind not in times else times[kind].fastest(timed)
            _install(model, originals)  # the packing goes: one at a time beside the float ones
    if cache is not None:
        cache.save({kind: asdict(t) for kind, t in times.items()}, switches)
    choice = choose(times)
    pack(model, choice.chosen, int4, switches)
    return choice


Switches = dict[tuple[int, int], int]  # int4+float16: (out, in) features -> int4 up to rows


def pack(
    model: Decoder,
    kind: WeightDtype,
    int4: dict[str, Int4Groups],
    switches: Switches | None = None,
) -> None:
    """Pack the model's linears as `kind`; int4+float16 measures where each shape switches,
    unless `switches` knows it already (and learns it)."""
    if kind is WeightDtype.INT4:
        pack_int4_linears(model, model.linear_sources, int4)
    elif kind is WeightDtype.INT4_FLOAT16:
        pack_int4_linears(model, model.linear_sources, int4, wide=True)
        known = len(switches or {})
        switches = calibrate_switch(model, switches)
        if len(switches) > known:
            log.info("int4+float16: float16 above %s rows", _said_switches(switches))
    else:
        pack_linears(model, kind)


SWITCH_ROWS = (1, 2, 4, 8, 16)


def calibrate_switch(
    model: nn.Module, known: Switches | None = None, rows: Sequence[int] = SWITCH_ROWS
) -> Switches:
    """int4+float16: where each shape of linear leaves the int4 kernel for its float16 form.
    Every layer of a shape is timed in both forms at each row count (all of them: what a step
    reads from memory, not one layer that stays in cache); the shape stays int4 up to the most
    rows at which int4 was faster at every count up to it, and takes float16 above (0: at
    every batch). Shapes in `known` are not measured again. Sets each layer's wide_above;
    returns `known` with every shape's, by (out, in) features."""
    switches = {} if known is None else known
    by_shape: dict[tuple[int, int], list[Int4Linear]] = {}
    for layer in model.modules():
        if isinstance(layer, Int4Linear) and layer.wide is not None:
            by_shape.setdefault((layer.out_features, layer.in_features), []).append(layer)
    with torch.inference_mode():
        for shape, layers in by_shape.items():
            if shape not in switches:
                switches[shape] = _int4_up_to(layers, rows)
            for layer in layers:
                layer.wide_above = switches[shape]
    return switches


def _int4_up_to(layers: list[Int4Linear], rows: Sequence[int]) -> int:
    def narrow(x: torch.Tensor) -> Callable[[], object]:
        return lambda: [m.narrow(x) for m in layers]

    def wide(x: torch.Tensor) -> Callable[[], object]:
        return lambda: [m.wide(x) for m in layers if m.wide is not None]

    above = 0
    for count in rows:
        x = torch.randn(count, layers[0].in_features)
        if _least_ms(narrow(x), runs=3) > _least_ms(wide(x), runs=3):
            break
        above = count
    return above


def _said_switches(switches: Switches) -> str:
    return ", ".join(f"{n}x{k}: {above}" for (n, k), above in switches.items())


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear)}


def _install(model: nn.Module, linears: dict[str, nn.Module]) -> None:
    for path, layer in linears.items():
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)


# --- measuring a model's steps ----------------------------------------------------------------


def step_times(rows: int, page_size: int = 16) -> Measure:
    """A Measure: the model's real steps over a scratch pool of its own (zeros), decode at one
    row and at `rows`, each attending to CONTEXT_MEASURED positions, and a prefill of
    PREFILL_MEASURED tokens; the least of a few runs of each, after a warm-up (choose_packing
    calls it ROUNDS times per candidate and keeps the least of those too)."""

    def measure(model: Decoder) -> StepTimes:
        c = model.config
        per_row = -(-(CONTEXT_MEASURED + 1) // page_size)
        # the prefill writes the first pages, whichever rows' they are (scratch: only time counts)
        pages = max(rows * per_row, -(-PREFILL_MEASURED // page_size))
        dtype = model.embed.dtype
        shape = (c.num_layers, pages, page_size, c.num_kv_heads, c.head_dim)
        k_pool, v_pool = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        table = torch.arange(pages).view(rows, per_row)

        def decode(n: int) -> Callable[[], object]:
            positions = torch.full((n,), CONTEXT_MEASURED, dtype=torch.int64)
            keys = torch.arange(per_row * page_size)
            batch = StepBatch(
                is_prefill=False,
                slot_mapping=table[:n, CONTEXT_MEASURED // page_size] * page_size
                + CONTEXT_MEASURED % page_size,
                cu_seqlens=[],
                page_table=table[:n],
                key_mask=(keys[None, :] <= positions[:, None])[:, None, None, :],
                query_positions=positions,
            )
            ids = torch.ones(n, dtype=torch.int64)
            return lambda: model(ids, positions, batch, k_pool, v_pool, torch.arange(n))

        def prefill() -> object:
            n = PREFILL_MEASURED  # into the first pages: slots 0..n-1
            batch = StepBatch(is_prefill=True, slot_mapping=torch.arange(n), cu_seqlens=[0, n])
            ids = torch.ones(n, dtype=torch.int64)
            last = torch.tensor([n - 1])
            return model(ids, torch.arange(n), batch, k_pool, v_pool, last)

        return StepTimes(
            decode_one=_least_ms(decode(1), runs=3),
            decode_many=_least_ms(decode(rows), runs=2),
            rows=rows,
            prefill=_least_ms(prefill, runs=1),
        )

    return measure


def _least_ms(run: Callable[[], object], runs: int) -> float:
    run()  # warm-up: first-call allocations, packed-weight caches
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1000
