"""The internal protocol between the router and the engine roles: the token header, the
request bodies of /internal/*, and the JSON lines of a delta stream. Torch-free: the router
speaks it without loading the engine."""

from typing import Any

from pydantic import BaseModel, Field

from kvfence_engine.core.deltas import Delta
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import SamplingParams, TokenLogprob

TOKEN_HEADER = "X-Kvfence-Internal-Token"
REQUEST_ID = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")


class Sampling(BaseModel):
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, **self.model_dump())


class ReserveBody(BaseModel):
    request_id: str = REQUEST_ID
    prompt_ids: list[int] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    sampling: Sampling = Field(default_factory=Sampling)


class HandleBody(BaseModel):
    request_id: str = REQUEST_ID
    seq_id: int
    pages: list[int]
    tags: list[int]
    reserved_tokens: int
    transfer_port: int = Field(ge=1, le=65535)
    transfer_host: str = "127.0.0.1"


class PrefillBody(BaseModel):
    handle: HandleBody
    prompt_ids: list[int] = Field(min_length=1)
    sampling: Sampling = Field(default_factory=Sampling)


class FirstToken(BaseModel):
    token_id: int = Field(ge=0)
    logprob: float = 0.0
    top: list[tuple[int, float]] = Field(default_factory=list)

    def as_logprob(self) -> TokenLogprob:
        return TokenLogprob(self.token_id, self.logprob, tuple(self.top))

    @classmethod
    def of(cls, lp: TokenLogprob) -> "FirstToken":
        return cls(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top))


class DecodeBody(BaseModel):
    request_id: str = REQUEST_ID
    first: FirstToken


class AbortBody(BaseModel):
    request_id: str = REQUEST_ID


def delta_json(delta: Delta) -> dict[str, Any]:
    return {
        "token_ids": delta.token_ids,
        "logprobs": [FirstToken.of(lp).model_dump() for lp in delta.logprobs],
        "finish_reason": delta.finish_reason,
        "error": None
        if delta.error is None
        else {"status": delta.error.status, **delta.error.body()["error"]},
    }


def delta_from_json(data: dict[str, Any]) -> Delta:
    error = data.get("error")
    return Delta(
        token_ids=list(data["token_ids"]),
        logprobs=[FirstToken(**lp).as_logprob() for lp in data["logprobs"]],
        finish_reason=data.get("finish_reason"),
        error=None
        if error is None
        else EngineError(
            int(error["status"]),
            error["message"],
            error["type"],
            error["code"],
            error.get("param"),
        ),
    )
