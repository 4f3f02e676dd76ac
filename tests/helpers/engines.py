"""In-process tiny-random engines, and the prompts and budgets tests give them."""

from typing import TypedDict, Unpack

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.faults import Faults
from kvfence_engine.core.pool_plan import ContextPolicy
from kvfence_engine.core.request import Request, SamplingParams, is_terminal
from kvfence_engine.loading.loader import TINY_CONFIG, LoadedModel, int4_groups, tiny_random

from .pool_watch import watch_engine

TINY_TOKEN_BYTES = TINY_CONFIG.kv_bytes_per_token(4)


def tiny_budget(pages: int, page_size: int = 16) -> int:
    """The --kv-cache-memory that gives a tiny-random engine exactly `pages` pages."""
    return TINY_TOKEN_BYTES * page_size * pages


class TinyEngineOptions(TypedDict, total=False):
    """The EngineArgs a test may set; make_tiny_engine sets the KV budget (from `pages`) and
    the faults (by name)."""

    role: str
    page_size: int
    memory_fraction: float | None
    context_length: int | None
    context_policy: ContextPolicy
    device: str
    weight_dtype: str | None
    kv_cache_dtype: str | None
    max_num_seqs: int
    device_decode: bool | None
    enforce_eager: bool
    max_batched_tokens: int
    max_waiting: int
    scrub_on_free: bool
    revision: str
    transfer_port: int
    kv_checksum: bool
    reserve_timeout: float
    max_pool_share_per_tenant: float
    prefix_cache: bool
    prefix_cache_secret_file: str | None
    prefix_cache_share: float
    prefix_cache_tenants: int
    prefix_cache_idle_seconds: float


class SamplingOptions(TypedDict, total=False):
    """The SamplingParams a test may set; the admission gives max_tokens."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    logprobs: int | None
    ignore_eos: bool


def make_tiny_engine(
    *, pages: int = 64, faults: tuple[str, ...] = (), **kwargs: Unpack[TinyEngineOptions]
) -> LLMEngine:
    args = EngineArgs(
        kv_cache_memory=tiny_budget(pages, kwargs.get("page_size", 16)),
        faults=Faults.from_names(faults, {"KVFENCE_ALLOW_UNSAFE": "1"}),
        **kwargs,
    )
    return watch_engine(LLMEngine(tiny_random(), args))


def submit(
    engine: LLMEngine,
    prompt_ids: list[int],
    max_tokens: int | None = 8,
    **params: Unpack[SamplingOptions],
) -> Request:
    """Admit and enqueue; returns the sequence (terminal at once if rejected)."""
    sp = SamplingParams(max_tokens=1, **params)
    seq = engine.admit(prompt_ids, sp, max_tokens=max_tokens)
    if not is_terminal(seq):
        engine.add(seq)
    return seq


def run_until_done(engine: LLMEngine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not drain")


def generate(
    engine: LLMEngine, prompt_ids: list[int], max_tokens: int = 8, **params: Unpack[SamplingOptions]
) -> Request:
    seq = submit(engine, prompt_ids, max_tokens, **params)
    run_until_done(engine)
    return seq


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of exactly `length` ordinary token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (length,), generator=gen).tolist()


def tiny_q4(kind: GGMLQuantizationType = GGMLQuantizationType.Q4_1) -> LoadedModel:
    """tiny-random with every projection quantized as a GGUF would hold it: float weights are
    the file's dequantization, int4 its blocks (what load_gguf gives)."""
    loaded = tiny_random()
    for name, weight in list(loaded.weights.items()):
        if name.endswith("_proj.weight"):
            raw = quantize(weight.numpy(), kind)
            loaded.weights[name] = torch.from_numpy(dequantize(raw, kind))
            loaded.int4[name] = int4_groups(raw, kind)
    return loaded
