"""Internal endpoints of the disaggregated roles. Not for clients: the router calls them, and
with --internal-token-file they refuse calls that do not carry the token.

decode:  POST /internal/reserve  admit, then allocate the prompt's pages -> transfer handle
         POST /internal/decode   verify the received KV, continue from prefill's first token
         POST /internal/abort    drop a request (pages fenced while a transfer still writes)
prefill: POST /internal/prefill  admit, compute the prompt's KV and first token (with
                                 --prefix-cache: only past the tenant's cached pages), stream the
                                 whole KV to decode's transfer port, return the first token
"""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header
from fastapi.responses import StreamingResponse

from kvfence_engine.auth import secret_matches
from kvfence_engine.contracts import (
    TOKEN_HEADER,
    AbortBody,
    AbortReply,
    DecodeBody,
    ErrorCode,
    PrefillBody,
    PrefillReply,
    ReserveBody,
    ReserveReply,
    Role,
)
from kvfence_engine.core import errors
from kvfence_engine.core.deltas import Delta
from kvfence_engine.core.request import SamplingParams, TokenLogprob, is_terminal
from kvfence_engine.disagg.receiver import HELLO_TIMEOUT, MAX_CONNECTIONS, KVReceiver
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.disagg.transfer import Handle, Layout, TransferError, send_kv
from kvfence_engine.disagg.wire import delta_line, first_token, token_logprob
from kvfence_engine.serving.async_engine import AsyncEngine
from kvfence_engine.serving.gate import checked_first
from kvfence_engine.serving.state import ServerState


def internal_router(
    state: ServerState,
    *,
    transfer_host: str = "127.0.0.1",
    transfer_port: int = 0,
    transfer_max_connections: int = MAX_CONNECTIONS,
    transfer_hello_timeout: float = HELLO_TIMEOUT,
) -> APIRouter:
    """The internal endpoints. In the decode role this also sets up, once the engine is
    ready, its reservations and the KV receiver on (transfer_host, transfer_port) that writes
    into them (port 0: any free port; the engine reports the one it got), serving at most
    `transfer_max_connections` at once, each of which must say HELLO within
    `transfer_hello_timeout` seconds."""
    reservations: DecodeReservations | None = None

    def start_decode_side(engine: AsyncEngine) -> None:
        """(loader thread, before the engine's loop starts and before it is served)"""
        nonlocal reservations
        reservations = DecodeReservations(engine.engine)
        engine.housekeeping.append(reservations.expire)
        receiver = KVReceiver(
            reservations,
            transfer_host,
            transfer_port,
            state.internal_token,
            hello_timeout=transfer_hello_timeout,
            max_connections=transfer_max_connections,
        )
        engine.engine.args.transfer_port = receiver.port
        receiver.start()

    if state.role is Role.DECODE:
        state.on_ready.append(start_decode_side)

    def check_token(
        token: Annotated[str | None, Header(alias=TOKEN_HEADER)] = None,
    ) -> None:
        if state.internal_token is not None and not secret_matches(token, state.internal_token):
            raise errors.unauthorized("internal endpoint: missing or wrong internal token")

    # The token is checked on the headers before the body is read (serving/gate.py); the
    # dependency documents the header in the OpenAPI schema.
    router = APIRouter(
        prefix="/internal",
        dependencies=[Depends(check_token)],
        route_class=checked_first(lambda request: check_token(request.headers.get(TOKEN_HEADER))),
    )

    def engine_for(role: Role) -> AsyncEngine:
        engine = state.require_engine()
        if state.role != role:
            raise errors.wrong_role(f"this engine runs the {state.role} role, not {role}")
        return engine

    def decode_side() -> tuple[AsyncEngine, DecodeReservations]:
        engine = engine_for(Role.DECODE)
        assert reservations is not None  # set up before the engine was served
        return engine, reservations

    @router.post("/reserve")
    async def reserve(body: ReserveBody) -> ReserveReply:
        engine, book = decode_side()
        seq = engine.admit(
            body.prompt_ids, SamplingParams.of(body.sampling), body.max_tokens, body.tenant
        )
        if is_terminal(seq):  # rejected before any page was allocated
            assert seq.error is not None
            raise seq.error
        handle = await engine.call(lambda: book.reserve(seq, body.request_id))
        return ReserveReply(**handle.to_json(), max_tokens=seq.params.max_tokens)

    @router.post("/decode")
    async def decode(body: DecodeBody) -> StreamingResponse:
        engine, book = decode_side()
        seq = book.pending(body.request_id)
        if seq is None:
            raise errors.unknown_request(f"no reservation {body.request_id!r} (expired or aborted)")
        first_logprob = token_logprob(body.first)
        deltas = engine.stream(seq, lambda: book.start_decode(body.request_id, first_logprob))
        first = await anext(deltas)
        if first.error is not None:
            await deltas.aclose()
            raise first.error
        return StreamingResponse(_ndjson(first, deltas), media_type="application/x-ndjson")

    @router.post("/abort")
    async def abort(body: AbortBody) -> AbortReply:
        engine, book = decode_side()
        seq = await engine.call(lambda: book.abort(body.request_id))
        return AbortReply(aborted=seq is not None)

    @router.post("/prefill")
    async def prefill(body: PrefillBody) -> PrefillReply:
        engine = engine_for(Role.PREFILL)
        seq = engine.admit(
            body.prompt_ids, SamplingParams.of(body.sampling), 1, body.tenant, body.cache_salt
        )
        if is_terminal(seq):
            assert seq.error is not None
            raise seq.error
        seq.export_kv = True
        last: Delta | None = None
        async for delta in engine.stream(seq):
            last = delta
        assert last is not None
        if last.error is not None:  # e.g. failed closed by the read check: no first token
            raise last.error
        assert seq.output_ids
        assert seq.exported is not None
        k, v, written = seq.exported
        seq.exported = None
        handle = Handle(**body.handle.model_dump())
        try:
            await asyncio.to_thread(
                send_kv,
                handle,
                k,
                v,
                written,
                Layout.of(engine.engine.pages.kv),
                token=state.internal_token,
                verify=engine.engine.args.kv_checksum,
            )
        except TransferError as exc:
            if exc.code is ErrorCode.TOO_MANY_CONNECTIONS:  # decode is busy: a retry may find room
                raise errors.overloaded(f"KV transfer to decode refused: {exc}") from exc
            status = 500 if exc.code is ErrorCode.KV_ISOLATION_VIOLATION else 502
            message = f"KV transfer to decode failed: {exc}"
            raise errors.transfer_failed(message, exc.code, status) from exc
        except OSError as exc:
            raise errors.transfer_failed(f"KV transfer to decode failed: {exc}") from exc
        logprob = (
            seq.output_logprobs[0] if seq.output_logprobs else TokenLogprob(seq.output_ids[0], 0.0)
        )
        return PrefillReply(
            first=first_token(logprob),
            prompt_tokens=len(body.prompt_ids),
            kv_tokens=written,
            cached_tokens=seq.cached_tokens,
        )

    return router


async def _ndjson(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[str]:
    try:
        yield json.dumps(delta_line(first).model_dump()) + "\n"
        if first.finish_reason is None:
            async for delta in rest:
                yield json.dumps(delta_line(delta).model_dump()) + "\n"
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
