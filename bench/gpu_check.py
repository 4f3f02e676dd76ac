"""Ready for a GPU: `kvfence serve` against Hugging Face transformers on one device, with seeded
random weights of a real model's shape. Needs no network and downloads nothing.

In order, under a deadline (--deadline, default 440 s; bench/gpu_check.sh adds a hard 8-minute
cap):

1. a model folder (config.json, model.safetensors, tokenizer.json) is written into a temporary
   directory. config.json is Llama-3.2-1B's own (bench/configs/llama-3.2-1b.json: its llama3
   rope_scaling, rope_theta 500000, tied embeddings, head_dim 64; `--shape llama-3.2-1b`, the
   default), or for a CPU smoke test (`--shape tiny`) the same file at hidden size 64, 2 layers
   and a vocabulary of 2048, its RoPE scaling and 131072 positions kept; seeded random weights
   (normal, std 0.02, RMSNorm gains 1) in --dtype; a word-level tokenizer built from the
   benchmark conversations (bench/_common.py). A second folder of the tiny shape is for the
   fault probe (7). Both systems' readings of the config (the shape, and the RoPE
   frequencies bit for bit) are compared before anything is measured;
2. `kvfence serve --model FOLDER --device DEVICE` starts as a real process on a loopback port
   (combined role, --max-num-seqs twice the highest concurrency), while transformers loads the
   same folder in this process, on the same device. The engine's KV pool must hold every
   measured batch at once and its context the longest prompt (checked before measuring);
3. the engine's greedy tokens (temperature 0, as ids named in its logprobs) at concurrency 1, 32
   and 128: the untimed first pass of each measured shape (first calls pay for kernel selection,
   allocator growth and the lazily touched KV pool), kept for the agreement (5);
4. output tokens/s at concurrency 1 (8 requests one after another over the OpenAI HTTP API,
   against transformers `generate` with batch 1), 32 and 128 (that many requests in flight,
   against one left-padded transformers batch of the same prompts; transformers gets one
   untimed pass of each first), each answer whole, and the read check's share of the engine's
   step time, from its Prometheus counters (kvfence_engine_step_seconds,
   kvfence_kv_read_check_seconds: host time) read before and after. Then the same requests
   streamed (server-sent events, one per token): each gives its time to first token (TTFT,
   median and p90) and its decode rate, and the run its streamed tokens/s. Streaming is timed
   apart because its per-token events are the server's work in the engine's process: on the
   shared 2-core CPU, 128 streamed requests once took 4-5x as long as whole ones (another time
   no longer), which would bury the engine in the comparison with transformers' in-process call;
5. greedy agreement, as token ids, at each concurrency, and each prompt's first divergence. At
   a concurrency-1 divergence, transformers' own logits give the gap between its token and ours,
   also in units of the dtype's spacing at that logit: a gap of a few spacings is a near-tie
   flipped by rounding, not a bug;
6. long prompts, the engine only, streamed: prompts of 512 and 8192 tokens (BOS and the
   benchmark words over and over; a length is capped at the served context less --new-tokens,
   which neither shape needs: both serve 131072 positions), 3 requests one after another each,
   and 32 of 512 in flight: tokens/s, decode tokens/s (the concurrency times the median
   request's rate after its first token), TTFT and the read check's share. Each length is sent
   only these few times, with no warm-up: the median of 3 leaves out the first request's
   one-time costs;
7. the fault probe, on the same device with the tiny shape (it loads in seconds; its two
   engines start with the main one and are probed while transformers loads): `kvfence serve
   --unsafe-fault early-release` (KVFENCE_ALLOW_UNSAFE=1), which hands each request's first
   page back to the free list after its prefill, gets 8 concurrent requests of 32 tokens, so
   that every request's page-boundary allocations take another's robbed page; the read check
   must fail some of them closed (500 / the stream's error event, code kv_isolation_violation):
   "caught". With `--unsafe-fault no-tag-check` too it must catch none: "not caught";
8. the device read check (CUDA only, where kvfence_engine.core.paged_decode imports):
   `check_decode` alone, timed with CUDA events (triton.testing.do_bench, median), on a
   synthetic pool state like that of the c=32 and c=128 runs (bench/_device_check.py), and its
   share of their mean decode step. Its absence or failure is recorded, not fatal;
9. one summary table, also written as JSON to --out (partial, with "error", if a step failed).

Both systems get the same token ids and produce exactly --new-tokens tokens along the plain
greedy path (ours: ignore_eos; transformers: no EOS id), as in bench/engine_throughput.py. The
tokenizer names every id of the model with its own string, so the token strings the engine
returns as logprobs map back to ids.
"""

import argparse
import asyncio
import contextlib
import importlib
import itertools
import json
import math
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from _common import CONVERSATIONS, percentile
from _device_check import decode_check_inputs, time_check_decode
from engine_throughput import EngineClient, Streamed, Timing, send_all
from kvfence_engine.contracts import ErrorCode
from kvfence_engine.core.faults import ALLOW_ENV, Fault
from kvfence_engine.core.rope import rope_frequencies
from kvfence_engine.loading.config import load_config
from kvfence_engine.serving.connections import CLIENT_IDLE_SECONDS
from kvfence_engine.tools.localproc import LocalProcess, ProcessFailed

# How `kvfence serve` starts without installing the project (PYTHONPATH holds cli, engine and
# operator; bench/gpu_check.sh sets it). The one line to change when the CLI module moves.
KVFENCE_CMD = [
    sys.executable,
    "-c",
    "import sys; from kvfence_cli.main import main; sys.exit(main())",
]

SEQUENTIAL = 8  # prompts sent one after another (concurrency 1)
CONCURRENCIES = (1, 32, 128)  # 1: SEQUENTIAL prompts one after another; else all in flight
MAX_CONCURRENCY = max(CONCURRENCIES)
PROMPTS = max(SEQUENTIAL, MAX_CONCURRENCY)
# long prompts, the engine only: (prompt tokens, concurrency, requests); each length capped at
# the shape's context less the new tokens (long_runs)
LONG_RUNS = ((512, 1, 3), (8192, 1, 3), (512, 32, 32))
DEVICE_CHECK_AT = (32, 128)  # the batched runs whose pool state check_decode is timed on
PAGED_DECODE = "kvfence_engine.core.paged_decode"  # where check_decode lives, once it does
FAULT_REQUESTS = 8  # in flight at once on each fault probe's engine
FAULT_NEW_TOKENS = 32  # two page boundaries or more per request: allocations that take robbed pages
CAUGHT, NOT_CAUGHT = "caught", "not caught"
T = TypeVar("T")
INIT_STD = 0.02  # transformers' initializer_range
UNK, BOS, EOS = "[UNK]", "<|begin_of_text|>", "<|end_of_text|>"
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 180.0
# an idle connection is dropped well before the engine closes it (serving/connections.py): at
# the server's own 5 s, a reuse raced its close and read as ReadError on a loaded machine
KEEPALIVE_S = CLIENT_IDLE_SECONDS
LOG_TAIL_LINES = 60
ACCESS_LOG = re.compile(r'^INFO: +[0-9.:]+ - "(GET|POST) ')
STEP, CHECK = "kvfence_engine_step_seconds", "kvfence_kv_read_check_seconds"
DECODE_STEPS = "kvfence_engine_decode_steps"  # newer engines; else estimated (mean_decode_step)
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


def long_prompt(prompts: list[list[int]], length: int, index: int) -> list[int]:
    """BOS and then the prompts' words (each a token: the tokenizer is word level), from
    prompt `index` on and round again, `length` tokens in all: distinct for each index."""
    rotated = prompts[index % len(prompts) :] + prompts[: index % len(prompts)]
    words = itertools.cycle([word for prompt in rotated for word in prompt[1:]])
    return [prompts[0][0], *itertools.islice(words, length - 1)]


def encode_prompts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    bos, _ = special_ids(tokenizer.get_vocab_size())  # where build_tokenizer put BOS
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
    tokenizer = build_tokenizer(shape.vocab, prompt_texts(PROMPTS))
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
        str(2 * MAX_CONCURRENCY),
    ]


@contextlib.contextmanager
def engine_process(
    command: list[str],
    log_path: Path,
    keep_log: Path | None,
    env: Mapping[str, str] | None = None,
) -> Iterator[EngineProcess]:
    """A started (not yet ready) engine; stopped on exit, whatever happens, and its log copied
    to keep_log. On a failure the log's last lines go to stderr."""
    engine = EngineProcess(command, env=env, log_path=log_path)
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
    """The engine's step and read-check second counters, and its decode step count where it
    has one."""
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    found = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name != sample.name and name in (STEP, CHECK, DECODE_STEPS):
                found[name] = sample.value
    missing = {STEP, CHECK} - found.keys()
    if missing:
        raise ValueError(f"/metrics lacks {', '.join(f'{m}_total' for m in sorted(missing))}")
    return found


def counter_rise(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after.keys() & before.keys()}


def check_share(rise: dict[str, float]) -> dict[str, float]:
    """The read check's seconds over the engine's step seconds, both host time."""
    step, check = rise[STEP], rise[CHECK]
    return {"step_seconds": step, "check_seconds": check, "share": check / step if step else 0.0}


def batch_of(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The prompts measured at a concurrency: SEQUENTIAL of them at 1, else that many."""
    return prompts[: SEQUENTIAL if concurrency == 1 else concurrency]


async def engine_ids(
    ours: EngineClient, prompts: list[list[int]], by_name: dict[str, int], concurrency: int
) -> list[list[int]]:
    """The engine's greedy tokens as ids (named in its logprobs), `concurrency` requests in
    flight."""
    _, names = await send_all(prompts, ours.token_strings, concurrency)
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


# --- the engine's measurements ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineRun:
    """One timed engine measurement, and how the engine's counters rose during it."""

    concurrency: int
    prompt_tokens: list[int]
    seconds: float
    output_tokens: int
    counters: dict[str, float]
    streams: list[Streamed] = field(default_factory=list)  # its requests, where streamed

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


async def counted(
    client: httpx.AsyncClient, url: str, work: Awaitable[T]
) -> tuple[T, dict[str, float]]:
    """`work`'s result, and how the engine's counters rose while it ran."""
    before = await read_counters(client, url)
    result = await work
    return result, counter_rise(before, await read_counters(client, url))


async def whole_run(
    ours: EngineClient, client: httpx.AsyncClient, url: str, prompts: list[list[int]], c: int
) -> EngineRun:
    """The prompts, `c` in flight, each answered whole: the tokens/s compared with
    transformers (per-token events would add the server's streaming work to the engine's)."""
    (seconds, _), rise = await counted(client, url, send_all(prompts, ours.complete, c))
    tokens = len(prompts) * ours.max_tokens  # complete() checks each answer's count
    return EngineRun(c, [len(p) for p in prompts], seconds, tokens, rise)


async def streamed_run(
    ours: EngineClient, client: httpx.AsyncClient, url: str, prompts: list[list[int]], c: int
) -> EngineRun:
    """The prompts, streamed, `c` in flight; every one must bring all its tokens."""
    (seconds, streams), rise = await counted(client, url, send_all(prompts, ours.stream, c))
    for s in streams:
        if s.error_code is not None or s.completion_tokens != ours.max_tokens:
            raise RuntimeError(
                f"a streamed request ended with {s.error_code or 'no error'} after "
                f"{s.completion_tokens} of {ours.max_tokens} tokens"
            )
    tokens = sum(s.completion_tokens for s in streams)
    return EngineRun(c, [len(p) for p in prompts], seconds, tokens, rise, streams)


def latency(run: EngineRun) -> dict[str, Any]:
    """Of a streamed run: TTFT (median, p90) in ms, and the decode rate: the concurrency times
    the median request's tokens/s after its first token (at 1: that request's own rate)."""
    ttft = [s.first_token_s for s in run.streams if s.first_token_s is not None]
    rates = [r for s in run.streams if (r := s.decode_tokens_per_s) is not None]
    return {
        "streamed_tokens_per_s": run.tokens_per_s,
        "ttft_ms": {
            "median": statistics.median(ttft) * 1000,
            "p90": percentile(ttft, 90) * 1000,
        },
        "decode_tokens_per_s": run.concurrency * statistics.median(rates) if rates else None,
    }


def mean_decode_step(run: EngineRun) -> tuple[float, str]:
    """The engine's step seconds over its decode steps during the run, and where the step count
    came from: its own counter, else the tokens generated over the batch (one per row and
    step)."""
    steps = run.counters.get(DECODE_STEPS)
    if steps:
        return run.counters[STEP] / steps, f"{DECODE_STEPS}_total"
    return run.counters[STEP] / (run.output_tokens / run.concurrency), "generated tokens / batch"


@dataclass(frozen=True, slots=True)
class LongRun:
    prompt_tokens: int
    concurrency: int
    requests: int


def long_runs(context: int, new_tokens: int) -> list[LongRun]:
    """LONG_RUNS, each length capped so that prompt and new tokens fit the served context."""
    return [
        LongRun(min(length, context - new_tokens), concurrency, requests)
        for length, concurrency, requests in LONG_RUNS
    ]


def long_record(run: EngineRun) -> dict[str, Any]:
    return {
        "prompt_tokens": max(run.prompt_tokens),
        "concurrency": run.concurrency,
        "requests": len(run.streams),
        "seconds": run.seconds,
        **latency(run),
        "read_check": check_share(run.counters),
    }


def pages_needed(prompt_tokens: list[int], new_tokens: int, page_size: int) -> int:
    return sum(math.ceil((p + new_tokens) / page_size) for p in prompt_tokens)


def check_capacity(pool: dict[str, Any], batches: list[list[int]], new_tokens: int) -> None:
    """Every batch measured (its prompts' lengths) must fit the engine's pool at once, so that
    nothing is preempted, and each prompt its context; ValueError otherwise."""
    for lengths in batches:
        need = pages_needed(lengths, new_tokens, pool["page_size"])
        if need > pool["num_pages"]:
            raise ValueError(
                f"{len(lengths)} prompts of up to {max(lengths)} tokens need {need} KV pages, "
                f"the pool has {pool['num_pages']}: raise Shape.kv_cache_memory"
            )
        if max(lengths) + new_tokens > pool["context_length_effective"]:
            raise ValueError(
                f"a {max(lengths)}-token prompt and {new_tokens} new tokens exceed the served "
                f"context of {pool['context_length_effective']}"
            )


# --- the fault probe --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaultProbe:
    faults: tuple[Fault, ...]
    expected: str  # CAUGHT or NOT_CAUGHT

    @property
    def name(self) -> str:
        return ",".join(self.faults)

    def serve_args(self) -> list[str]:
        return [arg for fault in self.faults for arg in ("--unsafe-fault", fault.value)]


FAULT_PROBES = (
    FaultProbe((Fault.EARLY_RELEASE,), CAUGHT),
    FaultProbe((Fault.EARLY_RELEASE, Fault.NO_TAG_CHECK), NOT_CAUGHT),
)


@contextlib.contextmanager
def fault_engines(
    folder: Path, args: argparse.Namespace, logs: Path, out: Path | None
) -> Iterator[list[tuple[FaultProbe, EngineProcess]]]:
    """One started engine per fault probe, on the tiny shape's folder; all stopped on exit."""
    with contextlib.ExitStack() as stack:
        engines = []
        for probe in FAULT_PROBES:
            command = serve_args(folder, args, SHAPES["tiny"]) + probe.serve_args()
            slug = "-".join(probe.faults)
            keep = out.with_suffix(f".fault-{slug}.log") if out else None
            env = {ALLOW_ENV: "1"}
            log = logs / f"fault-{slug}.log"
            engines.append((probe, stack.enter_context(engine_process(command, log, keep, env))))
        yield engines


def fault_outcome(probe: FaultProbe, streams: list[Streamed]) -> dict[str, Any]:
    """How many requests the read check failed closed (kv_isolation_violation); any other
    error makes the outcome unexpected whatever the count."""
    codes = [s.error_code for s in streams]
    caught = codes.count(ErrorCode.KV_ISOLATION_VIOLATION)
    other = sorted({c for c in codes if c is not None and c != ErrorCode.KV_ISOLATION_VIOLATION})
    verdict = CAUGHT if caught else NOT_CAUGHT
    return {
        "requests": len(codes),
        "caught": caught,
        "other_errors": other,
        "verdict": verdict,
        "expected": probe.expected,
        "as_expected": verdict == probe.expected and not other,
    }


async def probe_faults(
    engines: list[tuple[FaultProbe, EngineProcess]], prompts: list[list[int]]
) -> dict[str, Any]:
    """FAULT_REQUESTS concurrent requests to each fault engine, once it is ready."""
    results: dict[str, Any] = {}
    for probe, engine in engines:
        with recorded(results, probe.name):
            engine.wait_loaded(READY_TIMEOUT_S)
            async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
                ours = EngineClient(client, engine.url, FAULT_NEW_TOKENS)
                _, streams = await send_all(prompts, ours.stream, len(prompts))
            results[probe.name] = fault_outcome(probe, streams)
    return results


@contextlib.contextmanager
def recorded(results: dict[str, Any], key: str) -> Iterator[None]:
    """A failure inside becomes results[key] = {"error": ...} instead of failing the run; the
    deadline (TimeoutError) still ends it."""
    try:
        yield
    except TimeoutError:
        raise
    except Exception as exc:
        results[key] = failure(exc)


def failure(exc: Exception) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"}


# --- the device read check --------------------------------------------------------------------


def device_check(
    runs: dict[int, EngineRun], pool: dict[str, Any], device: torch.device, new_tokens: int
) -> dict[str, Any]:
    """check_decode timed alone on the pool state of each DEVICE_CHECK_AT run, and its share of
    that run's mean decode step (bench/_device_check.py); {"error": ...} where it cannot run."""
    if device.type != "cuda":
        return {"error": f"CUDA only; this run is on {device}"}
    try:
        check_decode = importlib.import_module(PAGED_DECODE).check_decode
        do_bench = importlib.import_module("triton.testing").do_bench
    except (ImportError, AttributeError, RuntimeError) as exc:  # not written yet, or no Triton
        return failure(exc)
    results: dict[str, Any] = {}
    for concurrency in DEVICE_CHECK_AT:
        with recorded(results, str(concurrency)):
            run = runs[concurrency]
            inputs = decode_check_inputs(
                run.prompt_tokens, new_tokens, pool["num_pages"], pool["page_size"]
            ).to(device)
            timed = time_check_decode(check_decode, do_bench, inputs)
            step_s, source = mean_decode_step(run)
            results[str(concurrency)] = timed | {
                "decode_step_ms": step_s * 1000,
                "share": timed["check_ms"] / (step_s * 1000),
                "decode_step_from": source,
            }
    return results


# --- the run ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Measured:
    system: str
    concurrency: int
    tokens_per_s: float  # ours: answered whole
    seconds: float
    # ours only: the same requests streamed
    streamed_tokens_per_s: float | None = None
    ttft_ms: dict[str, float] | None = None
    decode_tokens_per_s: float | None = None


def engine_measured(whole: EngineRun, streamed: EngineRun) -> Measured:
    return Measured(OURS, whole.concurrency, whole.tokens_per_s, whole.seconds, **latency(streamed))


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


def reference_run(
    reference: Reference, prompts: list[list[int]], concurrency: int
) -> tuple[Timing, list[list[int]]]:
    """Transformers at a concurrency: batch 1 one prompt after another, else one batch."""
    return reference.one_at_a_time(prompts) if concurrency == 1 else reference.batch(prompts)


async def run(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    device, dtype, shape = torch.device(args.device), getattr(torch, args.dtype), SHAPES[args.shape]
    summary["environment"] = environment(device)
    clock = Clock(summary.setdefault("phases", {}))
    with tempfile.TemporaryDirectory(prefix="kvfence-gpu-check-") as tmp:
        folder, tiny = Path(tmp) / f"random-{args.shape}", Path(tmp) / "random-tiny-faults"
        with clock.phase("model folders"):
            tokenizer = write_model(folder, shape, dtype, device, args.seed)
            by_name = ids_by_name(tokenizer)
            prompts = encode_prompts(tokenizer, prompt_texts(PROMPTS))
            tiny_tokenizer = write_model(tiny, SHAPES["tiny"], dtype, device, args.seed)
            fault_prompts = encode_prompts(tiny_tokenizer, prompt_texts(FAULT_REQUESTS))
        lengths = [len(p) for p in prompts]
        summary["prompt_tokens"] = {"min": min(lengths), "max": max(lengths)}
        command = serve_args(folder, args, shape)
        keep_log = args.out.with_suffix(".engine.log") if args.out else None
        with engine_process(command, Path(tmp) / "engine.log", keep_log) as engine:
            with fault_engines(tiny, args, Path(tmp), args.out) as faulty:
                with clock.phase("transformers load (the engines load meanwhile)"):
                    reference = Reference(folder, device, dtype, args.new_tokens)
                    same_config(folder, reference)
                with clock.phase("fault probe"):
                    summary["fault_probe"] = await probe_faults(faulty, fault_prompts)
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
    """Throughput, TTFT, the read check's share and greedy agreement of a ready engine at `url`
    against transformers, then the engine's long prompts and the device read check, into
    summary."""
    new_tokens = reference.new_tokens
    # idle connections are let go before the engine closes them (--client-header-timeout,
    # 10 s): reusing one it is closing would be a ReadError
    limits = httpx.Limits(max_connections=2 * MAX_CONCURRENCY, keepalive_expiry=KEEPALIVE_S)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        pool = summary["engine"] = (await client.get(f"{url}/v1/kvpool")).json()
        ours = EngineClient(client, url, new_tokens)
        long = long_batches(prompts, long_runs(pool["context_length_effective"], new_tokens))
        batches = [batch_of(prompts, c) for c in CONCURRENCIES] + [b for _, b in long]
        check_capacity(pool, [[len(p) for p in b] for b in batches], new_tokens)
        with clock.phase("engine greedy ids (its warm-up)"):
            ours_ids = {
                c: await engine_ids(ours, batch_of(prompts, c), by_name, c) for c in CONCURRENCIES
            }
        with clock.phase("engine throughput"):
            runs = {
                c: await whole_run(ours, client, url, batch_of(prompts, c), c)
                for c in CONCURRENCIES
            }
        summary["read_check"] = {str(c): check_share(r.counters) for c, r in runs.items()}
        with clock.phase("engine streamed (TTFT)"):
            streamed = {
                c: await streamed_run(ours, client, url, batch_of(prompts, c), c)
                for c in CONCURRENCIES
            }
        theirs = transformers_runs(reference, prompts, clock)
        summary["throughput"] = throughput_rows(measurements(runs, streamed, theirs))
        with clock.phase("greedy agreement"):
            summary["agreement"] = agreements(reference, prompts, ours_ids, theirs)
        summary["long_prompts"] = []  # filled as each run ends: a cut run keeps what it has
        with clock.phase("engine long prompts"):
            for r, batch in long:
                timed = await streamed_run(ours, client, url, batch, r.concurrency)
                summary["long_prompts"].append(long_record(timed))
    with clock.phase("device read check"):
        summary["device_check"] = device_check(runs, pool, reference.device, new_tokens)
    with clock.phase("decode kernels alone"):
        summary["kernels"] = decode_kernels(reference.device)


def decode_kernels(device: torch.device) -> dict[str, Any]:
    """bench/gpu_kernels.py's cases: paged decode attention against the gather path, and the
    read check kernel, alone; {"error": ...} where they cannot run."""
    if device.type != "cuda":
        return {"error": f"CUDA only; this run is on {device}"}
    try:
        cases = importlib.import_module("gpu_kernels").run_cases(device)
    except Exception as exc:  # reported, never fatal: the engine's own figures stand
        return failure(exc)
    return {"cases": cases}


def long_batches(
    prompts: list[list[int]], runs: list[LongRun]
) -> list[tuple[LongRun, list[list[int]]]]:
    return [
        (r, [long_prompt(prompts, r.prompt_tokens, i) for i in range(r.requests)]) for r in runs
    ]


def transformers_runs(
    reference: Reference, prompts: list[list[int]], clock: Clock
) -> dict[int, tuple[Timing, list[list[int]]]]:
    """Each concurrency's timing and token ids, after an untimed pass of each: the first
    prompt alone at 1, the batch itself at the others."""
    with clock.phase("transformers warm-up"):
        for c in CONCURRENCIES:
            reference_run(reference, batch_of(prompts, c)[:c], c)
    with clock.phase("transformers throughput"):
        return {c: reference_run(reference, batch_of(prompts, c), c) for c in CONCURRENCIES}


def measurements(
    whole: dict[int, EngineRun],
    streamed: dict[int, EngineRun],
    theirs: dict[int, tuple[Timing, list[list[int]]]],
) -> list[Measured]:
    ours = [engine_measured(whole[c], streamed[c]) for c in whole]
    return ours + [Measured(THEIRS, c, t.tokens_per_s, t.seconds) for c, (t, _) in theirs.items()]


def agreements(
    reference: Reference,
    prompts: list[list[int]],
    ours: dict[int, list[list[int]]],
    theirs: dict[int, tuple[Timing, list[list[int]]]],
) -> dict[str, Any]:
    """Token-id agreement at each concurrency; transformers' logit gaps at c=1's divergences."""
    result: dict[str, Any] = {str(c): agreement(ours[c], theirs[c][1]) for c in CONCURRENCIES}
    result["divergences_1"] = divergence_gaps(
        reference, batch_of(prompts, 1), ours[1], theirs[1][1]
    )
    return result


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
        batched = ", ".join(f"c={c}" for c in CONCURRENCIES if c > 1)
        lines.append(
            f"prompts: {lengths['min']}-{lengths['max']} tokens; c=1: {SEQUENTIAL} requests "
            f"one after another (transformers: batch 1); {batched}: all in flight at once "
            "(transformers: one left-padded batch); ours answered whole, then streamed"
        )
    lines += throughput_lines(summary.get("throughput", []))
    lines += long_prompt_lines(summary.get("long_prompts", []))
    lines += agreement_lines(summary.get("agreement"))
    lines += read_check_lines(summary.get("read_check", {}))
    lines += device_check_lines(summary.get("device_check"))
    lines += kernel_lines(summary.get("kernels"))
    lines += fault_probe_lines(summary.get("fault_probe"))
    pool = summary.get("engine", {})
    if pool:
        lines.append(
            f"engine: weights {pool.get('weight_dtype')}, KV {pool.get('kv_dtype')}, "
            f"{pool.get('pool_tokens')} pool tokens ({pool.get('num_pages')} pages), context "
            f"{pool.get('context_length_effective')}"
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


def ttft_cell(ttft_ms: dict[str, float] | None) -> str:
    return f"{ttft_ms['median']:.1f} / {ttft_ms['p90']:.1f}" if ttft_ms else ""


def throughput_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = [
        f"{'system':<14}{'c':>4}{'tokens/s':>12}{'vs transformers':>18}{'streamed tok/s':>16}"
        f"{'TTFT p50 / p90 ms':>22}"
    ]
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else ""
        streamed = row["streamed_tokens_per_s"]
        lines.append(
            f"{row['system']:<14}{row['concurrency']:>4}{row['tokens_per_s']:>12.1f}{ratio:>18}"
            f"{f'{streamed:.1f}' if streamed else '':>16}{ttft_cell(row['ttft_ms']):>22}"
        )
    return lines


def long_prompt_lines(records: list[dict[str, Any]]) -> list[str]:
    if not records:
        return []
    lines = [
        "long prompts (kvfence only):",
        f"{'prompt':>8}{'c':>4}{'requests':>10}{'tokens/s':>12}{'decode tok/s':>14}"
        f"{'TTFT p50 / p90 ms':>22}{'read check':>12}",
    ]
    for r in records:
        decode = f"{r['decode_tokens_per_s']:.1f}" if r["decode_tokens_per_s"] else ""
        lines.append(
            f"{r['prompt_tokens']:>8}{r['concurrency']:>4}{r['requests']:>10}"
            f"{r['streamed_tokens_per_s']:>12.1f}{decode:>14}{ttft_cell(r['ttft_ms']):>22}"
            f"{r['read_check']['share']:>12.2%}"
        )
    return lines


def agreement_lines(result: dict[str, Any] | None) -> list[str]:
    if not result:
        return []
    levels = [c for c in result if c != "divergences_1"]
    counts = ", ".join(
        f"c={c} {result[c]['identical']}/{result[c]['prompts']} prompts identical" for c in levels
    )
    lines = [f"greedy agreement (token ids): {counts}"]
    for c in levels:
        firsts = [f for f in result[c]["first_divergence"] if f is not None]
        if firsts:
            lines.append(f"  c={c} first divergences at tokens {sorted(firsts)}")
    for gap in result.get("divergences_1", []):
        lines.append(
            f"  c=1 prompt {gap['prompt']} token {gap['at']}: ours {gap['ours']}, theirs "
            f"{gap['theirs']}; transformers' logit gap {gap['logit_gap']:.4g} "
            f"({gap['gap_in_spacings']:.1f} spacings of the dtype at that logit)"
        )
    return lines


def read_check_lines(checks: dict[str, Any]) -> list[str]:
    if not checks:
        return []
    parts = [
        f"c={c} {v['share']:.2%} ({v['check_seconds']:.3f}s of {v['step_seconds']:.2f}s)"
        for c, v in checks.items()
    ]
    return ["read check (host) / engine step time: " + ", ".join(parts)]


def kernel_lines(result: dict[str, Any] | None) -> list[str]:
    if not result:
        return []
    if "error" in result:
        return [f"decode kernels alone: not measured: {result['error']}"]
    table_lines = importlib.import_module("gpu_kernels").table_lines
    return ["decode kernels alone (Llama-3.2-1B attention, bf16):", *table_lines(result["cases"])]


def device_check_lines(result: dict[str, Any] | None) -> list[str]:
    if result is None:
        return []
    if "error" in result:
        return [f"device read check (check_decode): not measured: {result['error']}"]
    parts = []
    for c, v in result.items():
        if "error" in v:
            parts.append(f"c={c} failed: {v['error']}")
            continue
        wrong = (
            ""
            if not (v["rows_failed"] or v["slots_wrong"])
            else (f" (WRONG: {v['rows_failed']} rows failed, {v['slots_wrong']} slots wrong)")
        )
        parts.append(
            f"c={c} {v['check_ms'] * 1000:.1f} us = {v['share']:.2%} of a "
            f"{v['decode_step_ms']:.2f} ms decode step{wrong}"
        )
    steps = {v.get("decode_step_from") for v in result.values()} - {None}
    return [
        f"device read check (check_decode; steps from {', '.join(sorted(steps))}): "
        + ", ".join(parts)
    ]


def fault_probe_lines(result: dict[str, Any] | None) -> list[str]:
    if not result:
        return []
    parts = []
    for name, v in result.items():
        if "error" in v:
            parts.append(f"{name} failed: {v['error']}")
            continue
        other = f", other errors {v['other_errors']}" if v["other_errors"] else ""
        mark = "as expected" if v["as_expected"] else f"UNEXPECTED, expected {v['expected']}"
        parts.append(f"{name} {v['caught']}/{v['requests']} {v['verdict']} ({mark}{other})")
    return [
        f"fault probe (tiny shape, {FAULT_REQUESTS} concurrent requests, kv_isolation_violation "
        "= caught): " + "; ".join(parts)
    ]


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
        "concurrencies": list(CONCURRENCIES),
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
