"""`--weight-dtype auto` on CPU for a GGUF with 4-bit blocks: int4, or int4+float16 (int4 up
to a few rows, float16 beyond), measured at start on the model itself (core/weight_choice.py).
The choice is a pure function of the times; packing each candidate in turn leaves the model as
the chosen one; the engine says why. Where int4+float16 switches is measured too."""

import pytest
import torch

from helpers.engines import generate, prompt_of, tiny_q4
from kvfence_engine.core import weight_choice
from kvfence_engine.core.decoder import Decoder
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.quantization import Int4Linear, WeightDtype
from kvfence_engine.core.weight_choice import (
    MARGIN,
    NEW_TOKENS,
    PREFILL_MEASURED,
    PROMPT_TOKENS,
    ROUNDS,
    StepTimes,
    calibrate_switch,
    choose,
)

INT4, FLOAT16, HYBRID = WeightDtype.INT4, WeightDtype.FLOAT16, WeightDtype.INT4_FLOAT16

# Measured on SmolLM2-135M, 2 threads, Intel Xeon (Sapphire Rapids class: AVX-512, AMX), AVX2
# emulated for ON_AVX2, with aten's int4 kernel (ms; decode 1 row, 16 rows, prefill of
# PREFILL_MEASURED = 256 tokens: 4x the 64-token prefill measured then)
ON_AVX512 = {INT4: StepTimes(15.2, 55.0, 16, 476), HYBRID: StepTimes(17.3, 61.3, 16, 368)}
ON_AVX2 = {INT4: StepTimes(17.2, 81.7, 16, 796), HYBRID: StepTimes(17.3, 69.5, 16, 468)}


def test_a_request_costs_its_prefill_and_its_share_of_each_decode_step() -> None:
    t = StepTimes(decode_one=10, decode_many=32, rows=16, prefill=20)
    prefill = 20 * PROMPT_TOKENS / PREFILL_MEASURED
    assert t.request_cost(1) == prefill + NEW_TOKENS * 10
    assert t.request_cost(16) == prefill + NEW_TOKENS * 2


def test_int4_where_it_is_fastest_at_one_row_and_close_at_many() -> None:
    """AVX-512: int4 10% cheaper alone, int4+float16 0.5% cheaper at 16 (its faster
    prefill): the worst case decides, so int4."""
    choice = choose(ON_AVX512)
    assert choice.chosen is INT4
    assert choice.worst[INT4] < 1.01 and choice.worst[HYBRID] > 1.08
    said = choice.reason()
    assert said.startswith("auto chose int4 by measurement on this CPU (")
    assert "int4: decode 1 row 15.2 ms, 16 rows 55.0 ms, prefill 256 tokens 476 ms" in said


def test_int4_float16_where_int4s_kernel_is_slow_at_many_rows() -> None:
    """AVX2: aten's int4 kernel is as fast alone and 1.7x slower at prefill and 16 rows."""
    choice = choose(ON_AVX2)
    assert choice.chosen is HYBRID and choice.worst[HYBRID] == 1.0
    assert choice.worst[INT4] > 1.3


def test_the_first_candidate_stays_unless_another_is_clearly_better() -> None:
    """Timing noise must not flip the choice from start to start where the two are close."""
    close = {INT4: StepTimes(10.0, 30.0, 16, 50), HYBRID: StepTimes(9.7, 29.1, 16, 48.5)}
    assert choose(close).chosen is INT4
    assert close[INT4].request_cost(1) / close[HYBRID].request_cost(1) - 1 < MARGIN
    clear = {INT4: StepTimes(10.0, 30.0, 16, 50), HYBRID: StepTimes(9.0, 27.0, 16, 45)}
    assert choose(clear).chosen is HYBRID


def test_a_packing_that_holds_more_must_beat_the_one_it_displaces_by_the_margin() -> None:
    """Listed by the bytes they hold: float16 is clearly better than int4, int4+float16
    only a little better than float16, so float16 (fewer bytes than int4+float16) serves."""
    times = {
        INT4: StepTimes(12.0, 36.0, 16, 60),
        FLOAT16: StepTimes(10.0, 30.0, 16, 50),
        HYBRID: StepTimes(9.8, 29.4, 16, 49),
    }
    choice = choose(times)
    assert choice.chosen is FLOAT16
    assert choice.worst[HYBRID] < choice.worst[FLOAT16] < choice.worst[INT4]


def test_int4_float16_switches_where_the_float16_form_starts_winning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each shape stays int4 up to the most rows at which its int4 form was faster at every
    count up to it; a shape already measured is not measured again."""
    engine = LLMEngine(tiny_q4(), EngineArgs(kv_cache_memory=16 << 20, weight_dtype="int4+float16"))
    model = engine.runner.model
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, Int4Linear)}
    # per shape, (int4 ms, float16 ms) at 1, 2, 4, 8, 16 rows: int4 wins at 1 and 2, loses
    # at 4, wins again at 8 (noise past the crossover must not move the switch up)
    script = [1.0, 2.0, 1.0, 2.0, 3.0, 2.0] * len(shapes)
    calls: list[int] = []

    def least_ms(run: object, runs: int) -> float:
        calls.append(1)
        return script[len(calls) - 1]

    monkeypatch.setattr(weight_choice, "_least_ms", least_ms)
    switches = calibrate_switch(model)
    assert switches == dict.fromkeys(shapes, 2)
    assert all(m.wide_above == 2 for m in model.modules() if isinstance(m, Int4Linear))
    assert len(calls) == 6 * len(shapes)  # stops at the first count int4 loses
    known = {shape: 8 for shape in shapes}
    assert calibrate_switch(model, known) == known and len(calls) == 6 * len(shapes)
    assert all(m.wide_above == 8 for m in model.modules() if isinstance(m, Int4Linear))


def _projections(model: Decoder) -> list[torch.nn.Module]:
    return [
        layer.get_submodule(n)
        for layer in model.layers
        for n in ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.down")
    ]


def _packed_as(model: Decoder) -> WeightDtype:
    layers = _projections(model)
    assert all(isinstance(m, Int4Linear) for m in layers), layers
    wide = {m.wide is not None for m in layers if isinstance(m, Int4Linear)}
    assert len(wide) == 1, wide
    return HYBRID if wide == {True} else INT4


@pytest.mark.parametrize(("times", "served"), [(ON_AVX512, INT4), (ON_AVX2, HYBRID)])
def test_each_candidate_is_measured_on_the_model_and_the_chosen_one_is_served(
    monkeypatch: pytest.MonkeyPatch, times: dict[WeightDtype, StepTimes], served: WeightDtype
) -> None:
    """The measure sees the model packed as each candidate in turn (then put back as it
    was); the engine serves the one the times choose, and says why in its report."""
    from kvfence_engine.core import build

    seen = []

    def measure(rows: int):
        def timed(model: Decoder) -> StepTimes:
            kind = _packed_as(model)
            seen.append(kind)
            return times[kind]

        return timed

    monkeypatch.setattr(build, "step_times", measure)
    engine = LLMEngine(tiny_q4(), EngineArgs(kv_cache_memory=16 << 20))
    assert seen == [INT4, HYBRID] * ROUNDS  # interleaved
    assert _packed_as(engine.runner.model) is served
    report = engine.kvpool_report()
    assert report.weight_dtype == str(choose(times).chosen)
    assert report.weight_choice == choose(times).reason()


def test_load_from_outside_during_one_round_does_not_decide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another engine starting on the same cores slows whatever is measured meanwhile: each
    candidate keeps its fastest of the interleaved rounds, so a slow first round of
    int4+float16 (AVX2's winner) does not hand the choice to int4."""
    from kvfence_engine.core import build

    loaded = iter([StepTimes(60.0, 250.0, 16, 1600)] + [ON_AVX2[HYBRID]] * (ROUNDS - 1))

    def measure(rows: int):
        def timed(model: Decoder) -> StepTimes:
            return ON_AVX2[INT4] if _packed_as(model) is INT4 else next(loaded)

        return timed

    monkeypatch.setattr(build, "step_times", measure)
    engine = LLMEngine(tiny_q4(), EngineArgs(kv_cache_memory=16 << 20))
    assert engine.precision.weights == HYBRID
    assert engine.precision.why == choose(ON_AVX2).reason()


def test_auto_measures_the_real_steps_and_serves_what_it_chose() -> None:
    """No stand-in: the real measure runs the model's decode and prefill steps over a scratch
    pool of its own; the engine then serves as with the chosen dtype asked for by name."""
    engine = LLMEngine(tiny_q4(), EngineArgs(kv_cache_memory=16 << 20))
    chosen = engine.precision.weights
    assert chosen in (INT4, HYBRID) and engine.precision.why is not None
    assert f"auto chose {chosen} by measurement" in engine.precision.why
    times = [float(x) for x in engine.precision.why.split() if x.replace(".", "").isdigit()]
    assert times and all(t >= 0 for t in times)
    named = LLMEngine(tiny_q4(), EngineArgs(kv_cache_memory=16 << 20, weight_dtype=chosen))
    # int4+float16's switches are measured by each engine: the named one takes auto's
    ours_int4 = [m for m in engine.runner.model.modules() if isinstance(m, Int4Linear)]
    named_int4 = [m for m in named.runner.model.modules() if isinstance(m, Int4Linear)]
    for mine, theirs in zip(ours_int4, named_int4, strict=True):
        theirs.wide_above = mine.wide_above
    prompt = prompt_of(20, seed=3)
    ours = generate(engine, prompt, 8, ignore_eos=True).output_ids
    assert ours == generate(named, prompt, 8, ignore_eos=True).output_ids
    assert engine.pages.num_used == 0  # the measurement's scratch pool is not the engine's
