"""A request as the engine tracks it, and the one predicate every stage uses to ask "done?".

No torch at import time: the router shares these types and never loads torch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from kvfence_engine.contracts import Sampling
from kvfence_engine.core.errors import EngineError

if TYPE_CHECKING:
    import torch


# Below this temperature sampling is greedy. With the largest logit shifted to 0 (sampler.py),
# a token whose logit is more than 104 * t below it has probability exactly 0 in float32
# (exp underflows below -104): at t = 1e-5 that is every token more than 0.001 below the top,
# so a smaller t changes nothing but the float32 ties it divides by ever smaller numbers.
MIN_TEMPERATURE = 1e-5


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # below MIN_TEMPERATURE (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; 0: the chosen token's; N: also top-N
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @classmethod
    def of(cls, sampling: Sampling) -> SamplingParams:
        """The engine's parameters for a request's `Sampling` (contracts: what the router
        sends, and what the engine's own API derives from an OpenAI body). `max_tokens` is
        the admission's, given apart."""
        return cls(max_tokens=1, **sampling.model_dump())


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class InboundKV:
    """Decode side: the KV a reserved request expects from prefill over the transfer port."""

    request_id: str
    reserved_tokens: int
    deadline: float  # the transfer must have started by then, or the reservation is dropped
    written_tokens: int = 0
    pages_written: set[int] = field(default_factory=set)  # each at most once per transfer
    in_flight: bool = False
    done: bool = False
    fenced: bool = False  # aborted while in flight: later writes are dropped, release deferred
    error: EngineError | None = None


@dataclass(slots=True, eq=False)
class Request:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The request's page table: written only by core/page_manager, read by everyone else.
    pages: list[int] = field(default_factory=list)
    page_tags: list[int] = field(default_factory=list)
    # Bumped each time the page table is replaced rather than grown (allocate, deallocate): a
    # copy of it elsewhere (core/device_decode) knows when it must copy it again.
    table_epoch: int = 0
    num_cached: int = 0  # tokens the engine believes are written in the pool
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | length | abort | error
    error: EngineError | None = None
    generator: torch.Generator | None = None  # the host path's draws (core/sampler)
    seed: int = 0  # what the device path's draws are a function of (core/device_sampler)
    first_token_at: float | None = None
    last_token_at: float | None = None  # when its latest token came (inter-token latency)
    request_id: str | None = None  # the router's id, for disaggregated requests
    tenant: str = "default"  # whose share of the KV pool it reserves (core/tenants)
    inbound: InboundKV | None = None  # decode role: KV still to arrive from prefill
    export_kv: bool = False  # prefill role: copy the prompt's KV out after the prefill step
    exported: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (k, v, tokens written)
    # Only the reject-placeholder fault sets this: the incident stored a rejection here, in a
    # field that is_terminal() does not read, so the request flowed on as a placeholder.
    placeholder_rejection: EngineError | None = None
    # Prefix cache (core/prefix_cache): the keys of the prompt's full pages (empty: the cache
    # is off), the client's salt that narrowed them, the leading tokens this prefill reads from
    # shared pages instead of computing, and the first prefill's hit (usage.cached_tokens).
    cache_keys: list[bytes] = field(default_factory=list)
    prefill_start: int = 0
    cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def finish(self, reason: str, error: EngineError | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error
        self.status = Status.FINISHED


def is_terminal(seq: Request) -> bool:
    """The single "is this request over?" check used by admission, scheduler and engine.

    A rejection is a finish_reason ("error") like any other, never a separate flag.
    """
    return seq.finish_reason is not None
