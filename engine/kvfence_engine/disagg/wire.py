"""The engine's side of the internal messages (kvfence_engine.contracts): from the wire to the
engine's own types and back. Torch-free: the router speaks it without loading the engine."""

from kvfence_engine.contracts import DeltaLine, FirstToken, WireError
from kvfence_engine.core import errors
from kvfence_engine.core.deltas import Delta
from kvfence_engine.core.request import TokenLogprob


def first_token(lp: TokenLogprob) -> FirstToken:
    return FirstToken(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top))


def token_logprob(first: FirstToken) -> TokenLogprob:
    return TokenLogprob(first.token_id, first.logprob, tuple(first.top))


def delta_line(delta: Delta) -> DeltaLine:
    error = delta.error
    return DeltaLine(
        token_ids=delta.token_ids,
        logprobs=[first_token(lp) for lp in delta.logprobs],
        finish_reason=delta.finish_reason,
        error=None
        if error is None
        else WireError(
            status=error.status,
            message=error.message,
            type=error.type,
            param=error.param,
            code=error.code,
        ),
    )


def delta_of(line: DeltaLine) -> Delta:
    error = line.error
    return Delta(
        token_ids=list(line.token_ids),
        logprobs=[token_logprob(lp) for lp in line.logprobs],
        finish_reason=line.finish_reason,
        error=None
        if error is None
        else errors.relayed(error.status, error.message, error.type, error.code, error.param),
    )
