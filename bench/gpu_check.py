"""Ready for a GPU: `kvfence serve` against Hugging Face transformers on one device, with seeded
random weights of a real model's shape. Needs no network and downloads nothing.

In order, under a deadline (--deadline, default 440 s; bench/gpu_check.sh adds a hard 8-minute
cap):

1. a model folder (config.json, model.safetensors, tokenizer.json) is written into a temporary
   directory. config.json is Llama-3.2-1B's own (bench/configs/llama-3.2-1b.json: its llama3
   rope_scaling, rope_theta 500000, tied embeddings, head_dim 64; `--shape llama-3.2-1b`, the
   default), or for a CPU smoke test (`--shape tiny`) the same file at hidden size 64, 2 layers
   and 2048 tokens, its RoPE scaling kept; seeded random weights (normal, std 0.02, RMSNorm
   gains 1) in --dtype; a word-level tokenizer built from the benchmark conversations
   (bench/_common.py). Both systems' readings of the config (the shape, and the RoPE
   frequencies bit for bit) are compared before anything is measured;
2. `kvfence serve --model FOLDER --device DEVICE` starts as a real process on a loopback port
   (combined role), while transformers loads the same folder in this process, on the same device;
3. output tokens/s at concurrency 1 (8 requests one after another over the OpenAI HTTP API,
   against transformers `generate` with batch 1) and at concurrency 32 (32 requests in flight,
   against one left-padded transformers batch of the same 32 prompts), after one untimed pass;
4. the read check's share of the engine's step time at each concurrency, from the engine's
   Prometheus counters read before and after;
5. greedy agreement, as token ids: the engine's tokens (temperature 0) against transformers' at
   concurrency 1 and 32, and each prompt's first divergence. At a concurrency-1 divergence,
   transformers' own logits give the gap between its token and ours, also in units of the dtype's
   spacing at that logit: a gap of a few spacings is a near-tie flipped by rounding, not a bug;
6. one summary table, also written as JSON to --out (partial, with "error", if a step failed).

Both systems get the same token ids and produce exactly --new-tokens tokens along the plain
greedy path (ours: ignore_eos; transformers: no EOS id), as in bench/engine_throughput.py. The
tokenizer names every id of the model with its own string, so the token strings the engine
returns as logprobs map back to ids.
"""

import argparse
import asyncio
import contextlib
import json
import math
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from _common import CONVERSATIONS
from engine_throughput import EngineClient, Timing
from kvfence_engine.core.rope import rope_frequencies
from kvfence_engine.loading.config import load_config
from kvfence_engine.tools.localproc import LocalProcess, ProcessFailed

# How `kvfence serve` starts without installing the project (PYTHONPATH holds cli, engine and
# operator; bench/gpu_check.sh sets it). The one line to change when the CLI module moves.
KVFENCE_CMD = [
    sys.executable,
    "-c",
    "import sys; from kvfence_cli.main import main; sys.exit(main())",
]

SEQUENTIAL = 8  # prompts sent one after another (concurrency 1)
CONCURRENCY = 32
INIT_STD = 0.02  # transformers' initializer_range
UNK, BOS, EOS = "[UNK]", "<|begin_of_text|>", "<|end_of_text|>"
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 180.0
LOG_TAIL_LINES = 60
ACCESS_LOG = re.compile(r'^INFO: +[0-9.:]+ - "(GET|POST) ')
STEP, CHECK = "kvfence_engine_step_seconds", "kvfence_kv_read_check_seconds"
THEIRS, OURS = "transformers", "kvfence"


CONFIGS = Path(__file__).resolve().parent / "configs"
LLAMA_3_2_1B: dict[str, Any] = json.loads((CONFIGS / "llama-3.2-1b.json").read_text())


@dataclass(frozen=True, slots=True)
class Shape:
    config: dict[str, Any]  # config.json, less what write_model sets (token ids, dtype)
    # the engine's KV pool: room for every request here, and for transformers beside it
    kv_cache_memory: str

    @property
    def vocab(self) -> int:
        return int(self.config["vocab_size"])


TINY = {
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
SHAPES = {
    "llama-3.2-1b": Shape(LLAMA_3_2_1B, "4Gi"),
    "tiny": Shape(LLAMA_3_2_1B | TINY, "64Mi"),
}


def special_ids(vocab: int) -> tuple[int, int]:
    """BOS and EOS where Llama 3 has them (128000, 128001 of 128256)."""
    return vocab - 256, vocab - 255


# --- the model folder -------------------------------------------------------------------------


def hf_config(shape: Shape, dtype: torch.dtype) -> dict[str, Any]:
    """config.json, as both the engine and transformers read it: the shape's, with BOS and EOS
    where the tokenizer has them (Llama 3.2's own ids at its vocabulary) and --dtype."""
    bos, eos = special_ids(shape.vocab)
    return shape.config | {
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def weight_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor of a tied-embedding Llama, in Hugging Face names."""
    c = s.config
    hidden, intermediate = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def random_weights(
    shape: Shape, dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """Seeded normal matrices (drawn on `device`, fast there), RMSNorm gains of one; on the host
    in `dtype`, ready to save."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, size in weight_shapes(shape).items():
        if len(size) == 1:
            weights[name] = torch.ones(size, dtype=dtype)
        else:
            drawn = torch.randn(size, generator=gen, device=device) * INIT_STD
            weights[name] = drawn.to(dtype).cpu()
    return weights


def prompt_texts(count: int) -> list[str]:
    """The benchmark conversations as plain text, numbered so that no two prompts are equal."""
    texts = []
    for i in range(count):
        turns = CONVERSATIONS[i % len(CONVERSATIONS)]
        texts.append(f"Request {i + 1}. " + " ".join(f"{m['role']}: {m['content']}" for m in turns))
    return texts


def build_tokenizer(vocab: int, texts: list[str]) -> Tokenizer:
    """Word level: [UNK], the texts' words, BOS and EOS at special_ids, and reserved names at
    every other id, so that each id of the model, sampled or not, decodes to its own string."""
    split = pre_tokenizers.Whitespace()
    words = sorted({word for text in texts for word, _ in split.pre_tokenize_str(text)})
    bos, eos = special_ids(vocab)
    if len(words) + 1 > bos:
        raise ValueError(f"{len(words)} words do not fit below id {bos}")
    tokens = [f"<|reserved_{i}|>" for i in range(vocab)]
    tokens[0] = UNK
    tokens[1 : 1 + len(words)] = words
    tokens[bos], tokens[eos] = BOS, EOS
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=UNK))
    tokenizer.pre_tokenizer = split
    tokenizer.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    return tokenizer


def ids_by_name(tokenizer: Tokenizer) -> dict[str, int]:
    """What the engine calls each id in logprobs (Tokenizer.token_text: decode([id])) -> the id."""
    vocab = tokenizer.get_vocab_size()
    names = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    by_name = {name: i for i, name in enumerate(names)}
    if len(by_name) != vocab:
        raise ValueError(f"{vocab - len(by_name)} token strings name more than one id")
    return by_name


def encode_prompts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    bos = tokenizer.token_to_id(BOS)
    prompts = [[bos, *tokenizer.encode(text, add_special_tokens=False).ids] for text in texts]
    unknown = tokenizer.token_to_id(UNK)
    if any(unknown in p for p in prompts):
        raise ValueError("a prompt word is missing from the tokenizer")
    return prompts


def write_model(
    folder: Path, shape: Shape, dtype: torch.dtype, device: torch.device, seed: int
) -> Tokenizer:
    """config.json + model.safetensors + tokenizer.json: what `kvfence serve --model` loads."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(hf_config(shape, dtype), indent=2))
    tokenizer = build_tokenizer(shape.vocab, prompt_texts(max(SEQUENTIAL, CONCURRENCY)))
    tokenizer.save(str(folder / "tokenizer.json"))
    weights = random_weights(shape, dtype, device, seed)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tokenizer


# --- ours: the engine as a process ------------------------------------------------------------


class EngineProcess(LocalProcess):
    """`kvfence serve`, started through KVFENCE_CMD, its output in log_path."""

    launcher = KVFENCE_CMD

    def wait_loaded(self, timeout: float) -> None:
        """Until /readyz says ready; fails at once if the process exits or its load failed."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessFailed(f"{self.describe()} exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = httpx.get(self.url + "/readyz", timeout=2.0)
                if response.status_code == 200:
                    return
                if response.json().get("status") == "failed":
                    raise ProcessFailed(f"{self.describe()}: {response.json().get('error')}")
            time.sleep(0.5)
        raise ProcessFailed(f"{self.describe()} not ready after {timeout:.0f}s")

    def log_tail(self) -> str:
        """The log's last lines, without uvicorn's one line per request (a traceback would
        scroll out behind 32 of them)."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        kept = [line for line in lines if not ACCESS_LOG.search(line)]
        return "\n".join(kept[-LOG_TAIL_LINES:])


def serve_args(folder: Path, args: argparse.Namespace, shape: Shape) -> list[str]:
    return [
        "serve",
        "--model",
        str(folder),
        "--device",
        args.device,
        "--weight-dtype",
        args.dtype,
        "--kv-cache-memory",
        shape.kv_cache_memory,
        "--max-num-seqs",
        str(2 * CONCURRENCY),
    ]


@contextlib.contextmanager
def engine_process(
    command: list[str], log_path: Path, keep_log: Path | None
) -> Iterator[EngineProcess]:
    """A started (not yet ready) engine; stopped on exit, whatever happens, and its log copied
    to keep_log. On a failure the log's last lines go to stderr."""
    engine = EngineProcess(command, log_path=log_path)
    engine.start()
    try:
        yield engine
    except BaseException:
        print(f"--- engine log, last {LOG_TAIL_LINES} lines ---", file=sys.stderr)
        print(engine.log_tail(), file=sys.stderr)
        raise
    finally:
        engine.stop()
        if keep_log is not None:
            with contextlib.suppress(OSError):
                keep_log.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log_path, keep_log)


async def read_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The engine's step and read-check second counters."""
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    found = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in (f"{STEP}_total", f"{CHECK}_total"):
                found[sample.name.removesuffix("_total")] = sample.value
    if len(found) != 2:
        raise ValueError(f"/metrics lacks {STEP}_total or {CHECK}_total")
    return found


def check_share(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    step = after[STEP] - before[STEP]
    check = after[CHECK] - before[CHECK]
    return {"step_seconds": step, "check_seconds": check, "share": check / step if step else 0.0}


async def engine_ids(
    ours: EngineClient, prompts: list[list[int]], by_name: dict[str, int], concurrent: bool
) -> list[list[int]]:
    """The engine's greedy tokens as ids (named in its logprobs), one request at a time or all
    at once."""
    if concurrent:
        names = await asyncio.gather(*(ours.token_strings(p) for p in prompts))
    else:
        names = [await ours.token_strings(p) for p in prompts]
    return [[by_name[name] for name in row] for row in names]


# --- theirs: transformers in this process -----------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Reference:
    """Hugging Face transformers on the same folder, device and dtype."""

    def __init__(
        self, folder: Path, device: torch.device, dtype: torch.dtype, new_tokens: int
    ) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        self.model = model.to(device).eval()
        # No EOS: generate exactly new_tokens along the plain greedy path.
        self.pad = int(self.model.config.eos_token_id)
        self.model.generation_config.eos_token_id = None
        self.device = device
        self.dtype = dtype
        self.new_tokens = new_tokens

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """One left-padded batch; each prompt's new token ids."""
        width = max(len(p) for p in prompts)
        padded = [[self.pad] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        out = self.model.generate(
            input_ids=torch.tensor(padded, device=self.device),
            attention_mask=torch.tensor(mask, device=self.device),
            do_sample=False,
            max_new_tokens=self.new_tokens,
            pad_token_id=self.pad,
        )
        generated = out[:, width:].tolist()
        assert all(len(g) == self.new_tokens for g in generated)
        return generated

    def one_at_a_time(self, prompts: list[list[int]]) -> tuple[Timing, list[list[int]]]:
        synchronize(self.device)
        start = time.perf_counter()
        outputs = [self.generate([p])[0] for p in prompts]
        return Timing(len(prompts) * self.new_tokens, time.perf_counter() - start), outputs

    def batch(self, prompts: list[list[int]]) -> tuple[Timing, list[list[int]]]:
        synchronize(self.device)
        start = time.perf_counter()
        outputs = self.generate(prompts)
        return Timing(len(prompts) * self.new_tokens, time.perf_counter() - start), outputs

    @torch.inference_mode()
    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits (float32, on the host) for the token after `ids`, in one forward pass."""
        logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits
        return logits[0, -1].float().cpu()


def same_config(folder: Path, reference: Reference) -> None:
    """The engine's reading of config.json and transformers' must describe one model."""
    ours = load_config(str(folder))
    c = reference.model.config
    theirs = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_layers": c.num_hidden_layers,
        "num_heads": c.num_attention_heads,
        "num_kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_eps": c.rms_norm_eps,
        "max_positions": c.max_position_embeddings,
        "tie_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
    }
    differ = {k: (getattr(ours, k), v) for k, v in theirs.items() if getattr(ours, k) != v}
    # transformers' RoPE frequencies and cos/sin scale (rope_parameters, with Llama 3.2's
    # llama3 scaling) against the engine's, which compute them with the same float32 ops
    rotary = reference.model.model.rotary_emb
    inv_freq, scale = rope_frequencies(
        ours.head_dim, ours.rope_theta, ours.rope, ours.max_positions
    )
    if (
        not torch.equal(rotary.inv_freq.float().cpu(), inv_freq)
        or scale != rotary.attention_scaling
    ):
        differ["rope"] = (
            (inv_freq[-3:].tolist(), scale),
            (rotary.inv_freq[-3:].tolist(), rotary.attention_scaling),
        )
    if differ:
        raise ValueError(f"engine and transformers read the config differently: {differ}")


# --- comparing --------------------------------------------------------------------------------


def first_divergences(ours: list[list[int]], theirs: list[list[int]]) -> list[int | None]:
    """Per prompt, the first position where the two differ (None: identical)."""
    return [
        next((j for j, (a, b) in enumerate(zip(o, t, strict=True)) if a != b), None)
        for o, t in zip(ours, theirs, strict=True)
    ]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    firsts = first_divergences(ours, theirs)
    return {
        "prompts": len(firsts),
        "identical": sum(f is None for f in firsts),
        "first_divergence": firsts,
    }


def spacing(value: float, dtype: torch.dtype) -> float:
    """The distance between neighbouring `dtype` numbers around `value`."""
    eps = torch.finfo(dtype).eps
    return eps * 2.0 ** math.floor(math.log2(abs(value))) if value else eps


def divergence_gaps(
    reference: Reference,
    prompts: list[list[int]],
    ours: list[list[int]],
    theirs: list[list[int]],
) -> list[dict[str, Any]]:
    """At each prompt's first divergence: transformers' logit of its token minus ours."""
    gaps = []
    for i, at in enumerate(first_divergences(ours, theirs)):
        if at is None:
            continue
        logits = reference.next_logits(prompts[i] + theirs[i][:at])
        theirs_logit = float(logits[theirs[i][at]])
        gap = theirs_logit - float(logits[ours[i][at]])
        gaps.append(
            {
                "prompt": i,
                "at": at,
                "ours": ours[i][at],
                "theirs": theirs[i][at],
                "logit_gap": gap,
                "gap_in_spacings": gap / spacing(theirs_logit, reference.dtype),
            }
        )
    return gaps


# --- the run ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Measured:
    system: str
    concurrency: int
    tokens_per_s: float
    seconds: float


class Clock:
    """Elapsed time of the whole run and of each phase, printed as it goes."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.t0 = time.perf_counter()
        self.phases = phases

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        print(f"[{start - self.t0:6.1f}s] {name} ...", flush=True)
        yield
        self.phases[name] = round(time.perf_counter() - start, 2)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {name}: {self.phases[name]:.1f}s")


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "device_name": name or device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


async def warm_up(
    ours: EngineClient, reference: Reference, sequential: list[list[int]], batch: list[list[int]]
) -> None:
    """One untimed pass of each measured shape: first calls pay for kernel selection, cuBLAS
    handles, allocator growth and the lazily touched KV pool."""
    await ours.one_at_a_time(sequential[:1])
    await ours.all_at_once(batch)
    reference.one_at_a_time(sequential[:1])
    reference.batch(batch)


async def measure_engine(
    ours: EngineClient,
    client: httpx.AsyncClient,
    url: str,
    sequential: list[list[int]],
    batch: list[list[int]],
    summary: dict[str, Any],
) -> list[Measured]:
    before = await read_counters(client, url)
    one = await ours.one_at_a_time(sequential)
    middle = await read_counters(client, url)
    many = await ours.all_at_once(batch)
    after = await read_counters(client, url)
    summary["read_check"] = {
        "1": check_share(before, middle),
        str(CONCURRENCY): check_share(middle, after),
    }
    return [
        Measured(OURS, 1, one.tokens_per_s, one.seconds),
        Measured(OURS, CONCURRENCY, many.tokens_per_s, many.seconds),
    ]


async def run(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    device, dtype, shape = torch.device(args.device), getattr(torch, args.dtype), SHAPES[args.shape]
    summary["environment"] = environment(device)
    clock = Clock(summary.setdefault("phases", {}))
    with tempfile.TemporaryDirectory(prefix="kvfence-gpu-check-") as tmp:
        folder = Path(tmp) / f"random-{args.shape}"
        with clock.phase("model folder"):
            tokenizer = write_model(folder, shape, dtype, device, args.seed)
            by_name = ids_by_name(tokenizer)
            prompts = encode_prompts(tokenizer, prompt_texts(max(SEQUENTIAL, CONCURRENCY)))
        lengths = [len(p) for p in prompts]
        summary["prompt_tokens"] = {"min": min(lengths), "max": max(lengths)}
        command = serve_args(folder, args, shape)
        keep_log = args.out.with_suffix(".engine.log") if args.out else None
        with engine_process(command, Path(tmp) / "engine.log", keep_log) as engine:
            with clock.phase("transformers load (the engine loads meanwhile)"):
                reference = Reference(folder, device, dtype, args.new_tokens)
                same_config(folder, reference)
            with clock.phase("engine ready"):
                engine.wait_loaded(READY_TIMEOUT_S)
            await compare(engine.url, reference, prompts, by_name, clock, summary)
    summary["total_seconds"] = round(time.perf_counter() - clock.t0, 1)


async def compare(
    url: str,
    reference: Reference,
    prompts: list[list[int]],
    by_name: dict[str, int],
    clock: Clock,
    summary: dict[str, Any],
) -> None:
    """Throughput, the read check's share and greedy agreement of a ready engine at `url`
    against transformers, into summary."""
    sequential, batch = prompts[:SEQUENTIAL], prompts[:CONCURRENCY]
    limits = httpx.Limits(max_connections=2 * CONCURRENCY)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        summary["engine"] = (await client.get(f"{url}/v1/kvpool")).json()
        ours = EngineClient(client, url, reference.new_tokens)
        with clock.phase("warm-up"):
            await warm_up(ours, reference, sequential, batch)
        with clock.phase("engine throughput"):
            measured = await measure_engine(ours, client, url, sequential, batch, summary)
        with clock.phase("transformers throughput"):
            one, theirs_1 = reference.one_at_a_time(sequential)
            many, theirs_32 = reference.batch(batch)
        measured += [
            Measured(THEIRS, 1, one.tokens_per_s, one.seconds),
            Measured(THEIRS, CONCURRENCY, many.tokens_per_s, many.seconds),
        ]
        summary["throughput"] = throughput_rows(measured)
        with clock.phase("greedy agreement"):
            ours_1 = await engine_ids(ours, sequential, by_name, concurrent=False)
            ours_32 = await engine_ids(ours, batch, by_name, concurrent=True)
        summary["agreement"] = {
            "1": agreement(ours_1, theirs_1),
            str(CONCURRENCY): agreement(ours_32, theirs_32),
            "divergences_1": divergence_gaps(reference, sequential, ours_1, theirs_1),
        }


def throughput_rows(measured: list[Measured]) -> list[dict[str, Any]]:
    """Each system and concurrency, with ours as a ratio of transformers' at the same one."""
    theirs = {m.concurrency: m.tokens_per_s for m in measured if m.system == THEIRS}
    rows = []
    for m in sorted(measured, key=lambda m: (m.concurrency, m.system != THEIRS)):
        ratio = m.tokens_per_s / theirs[m.concurrency] if m.system == OURS else None
        rows.append(asdict(m) | {"ratio": ratio})
    return rows


# --- the summary ------------------------------------------------------------------------------


def summary_lines(summary: dict[str, Any]) -> list[str]:
    env = summary.get("environment", {})
    lines = [
        f"== kvfence GPU check: {summary['shape']} {summary['dtype']} on {summary['device']} "
        f"({env.get('device_name', '?')}), {summary['new_tokens']} new tokens per request =="
    ]
    if "prompt_tokens" in summary:
        lengths = summary["prompt_tokens"]
        lines.append(
            f"prompts: {lengths['min']}-{lengths['max']} tokens; c=1: {SEQUENTIAL} requests "
            f"one after another (transformers: batch 1); c={CONCURRENCY}: all in flight at once "
            "(transformers: one left-padded batch)"
        )
    rows = summary.get("throughput", [])
    if rows:
        lines.append(f"{'system':<14}{'c':>4}{'tokens/s':>12}{'vs transformers':>18}")
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else ""
        lines.append(
            f"{row['system']:<14}{row['concurrency']:>4}{row['tokens_per_s']:>12.1f}{ratio:>18}"
        )
    lines += agreement_lines(summary.get("agreement"))
    checks = summary.get("read_check", {})
    if checks:
        parts = [
            f"c={c} {v['share']:.2%} ({v['check_seconds']:.3f}s of {v['step_seconds']:.2f}s)"
            for c, v in checks.items()
        ]
        lines.append("read check / engine step time: " + ", ".join(parts))
    pool = summary.get("engine", {})
    if pool:
        lines.append(
            f"engine: weights {pool.get('weight_dtype')}, KV {pool.get('kv_dtype')}, "
            f"{pool.get('pool_tokens')} pool tokens"
        )
    if env:
        lines.append(
            f"torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
            f"Python {env['python']}"
        )
    if "total_seconds" in summary:
        lines.append(f"total {summary['total_seconds']:.0f}s; phases {summary['phases']}")
    if "error" in summary:
        lines.append(f"FAILED: {summary['error']}")
    return lines


def agreement_lines(result: dict[str, Any] | None) -> list[str]:
    if not result:
        return []
    levels = ("1", str(CONCURRENCY))
    counts = ", ".join(
        f"c={c} {result[c]['identical']}/{result[c]['prompts']} prompts identical" for c in levels
    )
    lines = [f"greedy agreement (token ids): {counts}"]
    for c in levels:
        firsts = [f for f in result[c]["first_divergence"] if f is not None]
        if firsts:
            lines.append(f"  c={c} first divergences at tokens {sorted(firsts)}")
    for gap in result["divergences_1"]:
        lines.append(
            f"  c=1 prompt {gap['prompt']} token {gap['at']}: ours {gap['ours']}, theirs "
            f"{gap['theirs']}; transformers' logit gap {gap['logit_gap']:.4g} "
            f"({gap['gap_in_spacings']:.1f} spacings of the dtype at that logit)"
        )
    return lines


# --- entry ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="weights and compute of both systems (default: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument("--new-tokens", type=int, default=64, help="per request (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the summary here as JSON, and the engine's log beside it (.engine.log)",
    )
    parser.add_argument(
        "--deadline", type=float, default=440.0, help="seconds before giving up (default 440)"
    )
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = "float32" if torch.device(args.device).type == "cpu" else "bfloat16"
    if args.new_tokens < 1:
        parser.error("--new-tokens must be >= 1")
    return args


def arm_deadline(seconds: float) -> None:
    """Past the deadline, or on SIGTERM, raise in the main thread: the engine process is stopped
    and what was measured so far is still reported."""

    def expire(signum: int, _frame: FrameType | None) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        reason = f"deadline of {seconds:.0f}s passed" if signum == signal.SIGALRM else "SIGTERM"
        raise TimeoutError(reason)

    signal.signal(signal.SIGALRM, expire)
    signal.signal(signal.SIGTERM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def main() -> int:
    args = parse_args()
    summary: dict[str, Any] = {
        "shape": args.shape,
        "device": args.device,
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
        "seed": args.seed,
        "sequential_prompts": SEQUENTIAL,
        "concurrency": CONCURRENCY,
    }
    arm_deadline(args.deadline)
    try:
        asyncio.run(run(args, summary))
    except Exception as exc:
        traceback.print_exc()
        summary["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    print("\n".join(summary_lines(summary)), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if "error" in summary else 0


if __name__ == "__main__":
    sys.exit(main())
