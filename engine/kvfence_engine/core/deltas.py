"""The unit a request's output travels in, from the engine thread or from a decode backend."""

from dataclasses import dataclass

from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import TokenLogprob


@dataclass(slots=True)
class Delta:
    """What a request gained in one step; finish_reason set on the last one."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    error: EngineError | None = None
