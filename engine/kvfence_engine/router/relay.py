"""The relay protocol: one completion through a decode and a prefill instance.

Admission against the served context, then reserve pages on a decode instance (a refusal there
ends the request before prefill is touched), have a prefill instance compute the prompt's KV
and stream it to that decode instance, then relay decode's tokens. A client that leaves before
the first token exists does not cancel the work mid-transfer: both halves are cancelled once it
exists. An instance that does not answer, or answers as no instance of this deployment would,
leaves rotation; a backend's server-side error reaches the client as a generic message (the
detail goes to the log under the request id).
"""

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvfence_engine.contracts import (
    AbortBody,
    DecodeBody,
    DeltaLine,
    ErrorCode,
    FirstToken,
    PrefillBody,
    PrefillReply,
    ReserveBody,
    ReserveReply,
    Role,
    Sampling,
    TransferHandle,
)
from kvfence_engine.core import errors
from kvfence_engine.core.deltas import Delta
from kvfence_engine.core.errors import EngineError
from kvfence_engine.disagg.wire import delta_of
from kvfence_engine.router.backends import Backend
from kvfence_engine.router.keys import request_id_for
from kvfence_engine.router.state import RouterState
from kvfence_engine.router.tenants import Slot
from kvfence_engine.serving.openai_api import (
    OpenAIOutput,
    invalid_body,
    naming_prompt_field,
    prompt_field,
    respond,
)
from kvfence_engine.serving.protocol import ChatCompletionRequest, CompletionRequest, sampling_of

log = logging.getLogger(__name__)


async def in_flight(
    state: RouterState, tenant: str, admitted: Callable[[Slot], Awaitable[Response]]
) -> Response:
    """Run a request within its tenant's --max-concurrent-per-tenant: counted in now, out
    when its answer is over (a stream: when it ends, breaks or its client leaves)."""
    try:
        slot = state.inflight.enter(tenant)
    except EngineError as exc:
        state.metrics.rejected.labels(reason=exc.code).inc()
        raise
    try:
        response = await admitted(slot)
    except BaseException:
        slot.release()
        raise
    if not isinstance(response, StreamingResponse):
        slot.release()  # whole: the answer is over (a stream's deltas release it at their end)
    return response


async def relay(
    state: RouterState,
    slot: Slot,
    prompt_ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    request: Request,
) -> Response:
    """One completion through decode and prefill, once its tenant holds `slot`: admitted
    against the served context, reserved on decode, prefilled into that reservation, and
    decode's tokens as the OpenAI answer."""
    tenant = slot.tenant
    limit = await state.served_context()
    if not prompt_ids:  # what the engine's admission says, not ReserveBody's field name
        raise errors.invalid_request("the prompt is empty", "prompt")
    if len(prompt_ids) > limit:
        state.metrics.rejected.labels(reason=ErrorCode.CONTEXT_LENGTH_EXCEEDED).inc()
        raise errors.context_length_exceeded(
            len(prompt_ids), limit, "the served context", prompt_field(body)
        )
    sampling = sampling_of(body)
    request_id = request_id_for(tenant)
    try:
        reserve = ReserveBody(
            request_id=request_id,
            prompt_ids=prompt_ids,
            max_tokens=body.token_limit(),
            sampling=sampling,
            tenant=tenant,
        )
    except ValidationError as exc:  # what decode would refuse is the client's 400, as it was
        raise invalid_body(exc.errors()) from exc
    try:
        decode, handle = await _reserve(state, reserve)
    except EngineError as exc:  # decode's admission sees token ids, not the client's field
        raise naming_prompt_field(exc, body) from exc
    try:
        # Shielded: a client that leaves now must not cancel the prefill mid-transfer.
        prefill = asyncio.ensure_future(
            _prefill(state, decode, handle, prompt_ids, sampling, tenant, body.cache_salt)
        )
        prefilled = await asyncio.shield(prefill)
    except asyncio.CancelledError:
        state.in_background(_abort_after(state, decode, request_id, prefill))
        raise
    except EngineError:
        await _abort(state, decode, request_id)
        raise
    if await request.is_disconnected():
        # the first token exists now: cancel both halves (prefill is already done)
        await _abort(state, decode, request_id)
        return Response(status_code=499)
    deltas = slot.held_until_closed(_decode(state, decode, request_id, prefilled.first))
    chat = isinstance(body, ChatCompletionRequest)
    out = OpenAIOutput(chat, state.model_name, state.require_tokenizer(), len(prompt_ids))
    out.cached_tokens = prefilled.cached_tokens  # this tenant's own hit, decided by prefill
    try:
        first_delta = await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise
    return await respond(first_delta, deltas, out, body, request.is_disconnected)


ReplyT = TypeVar("ReplyT", bound=BaseModel)


# What a client reads instead of a backend's server-side error message, by error code. The
# engines' messages are for the router and the log: they may name an instance's address ("KV
# transfer to decode failed: ... 10.0.3.7:9000") or the pool's occupancy ("no free KV pages
# for 300 tokens: ... 3 free").
CLIENT_MESSAGES = {
    ErrorCode.OVERLOADED: "the service is at capacity; retry shortly",
    ErrorCode.NOT_READY: "the service is starting; retry shortly",
    ErrorCode.BACKEND_UNREACHABLE: "no instance of the service answered; retry shortly",
    ErrorCode.KV_ISOLATION_VIOLATION: "The request was stopped before generating from KV cache "
    "it does not own. No output was produced from that data.",
}


def client_facing(error: EngineError, request_id: str) -> EngineError:
    """A backend's error as the client may see it: a 4xx is about the request and passes on
    whole; a 5xx keeps its status, type, code and Retry-After, gets a generic message, and its
    detail is logged under the request id (which the client's message names)."""
    names_a_reference_only = error.code is ErrorCode.INTERNAL_ERROR
    if error.status < 500 or names_a_reference_only:
        return error
    log.warning("request %s: %s", request_id, error)
    generic = CLIENT_MESSAGES.get(error.code, "the service could not complete the request")
    return dataclasses.replace(error, message=f"{generic} (request {request_id})")


async def _call(
    state: RouterState,
    backend: Backend,
    role: Role,
    path: str,
    body: BaseModel,
    reply: type[ReplyT],
    request_id: str,
) -> ReplyT:
    """POST to an instance. Unreachable -> out of rotation + 503; its own error -> passed on
    as the client may see it."""
    backend.outstanding += 1
    try:
        r = await state.client.post(
            backend.url + path, json=body.model_dump(mode="json"), headers=state.headers()
        )
    except httpx.HTTPError as exc:
        why = f"is unreachable: {exc!r}"
        raise _out_of_rotation(state, backend, role, why, request_id) from exc
    finally:
        backend.outstanding -= 1
    if r.status_code >= 400:
        error = error_from(r)
        if error.code in NOT_AN_INSTANCE_OF_OURS:
            why = f"is not one of this deployment's: it answered {r.status_code} {error.message}"
            raise _out_of_rotation(state, backend, role, why, request_id)
        raise client_facing(error, request_id)
    return reply.model_validate_json(r.content)


# What an instance answers the router's internal calls when it is not an instance of this
# deployment: a pod IP another revision's engine (another internal token) now has, or a decode
# listed as prefill. Such an instance is out of rotation, as one that does not answer is; its
# answer never reaches the client as the client's own error (a 401 about a token the client
# never sent reads, to an OpenAI client, as a bad API key).
NOT_AN_INSTANCE_OF_OURS = frozenset({ErrorCode.UNAUTHORIZED, ErrorCode.WRONG_ROLE})


def _out_of_rotation(
    state: RouterState, backend: Backend, role: Role, why: str, request_id: str
) -> EngineError:
    """Take `backend` out of rotation; the client's 503 backend_unreachable (names no
    address)."""
    state.metrics.backend_errors.labels(role=role).inc()
    pool = state.backends.prefill if role is Role.PREFILL else state.backends.decode
    pool.mark_down(backend)
    unreachable = errors.backend_unreachable(f"{role} instance {backend.url} {why}")
    return client_facing(unreachable, request_id)


def error_from(r: httpx.Response) -> EngineError:
    try:
        e = r.json()["error"]
        return errors.relayed(
            r.status_code,
            e["message"],
            e["type"],
            ErrorCode(e["code"]),  # a code this version does not know: not one of ours
            e.get("param"),
            int(r.headers["retry-after"]) if "retry-after" in r.headers else None,
        )
    except (ValueError, KeyError, TypeError):
        return errors.bad_gateway(r.status_code)


async def _reserve(state: RouterState, body: ReserveBody) -> tuple[Backend, TransferHandle]:
    tried: set[str] = set()
    while True:
        decode = state.backends.decode.pick(tried)
        tried.add(decode.url)
        try:
            reply = await _call(
                state, decode, Role.DECODE, "/internal/reserve", body, ReserveReply, body.request_id
            )
        except EngineError as exc:
            if exc.code is not ErrorCode.BACKEND_UNREACHABLE:
                raise
            continue  # out of rotation now; try another decode instance
        handle = reply.model_dump(exclude={"max_tokens"}) | {"transfer_host": decode.host}
        return decode, TransferHandle.model_validate(handle)


async def _prefill(
    state: RouterState,
    decode: Backend,
    handle: TransferHandle,
    prompt_ids: list[int],
    sampling: Sampling,
    tenant: str,
    cache_salt: str | None,
) -> PrefillReply:
    """Prefill computes the prompt's KV (past the tenant's cached pages) into decode's
    reservation; its reply has the first token and how many prompt tokens were cached. With a
    routing secret the instance is the one placement ranks first for the tenant's prefix."""
    pool = state.backends.prefill
    routing = state.routing
    prefill = pool.pick() if routing is None else pool.pick_by_prefix(routing, tenant, prompt_ids)
    body = PrefillBody(
        handle=handle,
        prompt_ids=prompt_ids,
        sampling=sampling,
        tenant=tenant,
        cache_salt=cache_salt,
    )
    decode.outstanding += 1
    try:
        result = await _call(
            state,
            prefill,
            Role.PREFILL,
            "/internal/prefill",
            body,
            PrefillReply,
            handle.request_id,
        )
    finally:
        decode.outstanding -= 1
    return result


async def _abort(state: RouterState, decode: Backend, request_id: str) -> None:
    try:
        await state.client.post(
            decode.url + "/internal/abort",
            json=AbortBody(request_id=request_id).model_dump(),
            headers=state.headers(),
            timeout=5.0,
        )
    except httpx.HTTPError:
        log.warning("could not abort %s on %s", request_id, decode.url)


async def _abort_after(
    state: RouterState, decode: Backend, request_id: str, prefill: "asyncio.Future[PrefillReply]"
) -> None:
    """The client left during prefill: let the first token come into existence, then cancel
    both halves (prefill is done by then; decode drops the reservation)."""
    with contextlib.suppress(Exception):  # the reservation is dropped either way
        await prefill
    await _abort(state, decode, request_id)


async def _decode(
    state: RouterState, decode: Backend, request_id: str, first: FirstToken
) -> AsyncGenerator[Delta]:
    """Decode's token stream as deltas. A broken stream ends with a 503 error delta; closing
    this iterator (client gone) closes the stream, which aborts the request on decode."""
    decode.outstanding += 1
    finished = False
    try:
        async with state.client.stream(
            "POST",
            decode.url + "/internal/decode",
            headers=state.headers(),
            json=DecodeBody(request_id=request_id, first=first).model_dump(mode="json"),
        ) as r:
            if r.status_code >= 400:
                await r.aread()
                finished = True
                yield Delta([], [], "error", client_facing(error_from(r), request_id))
                return
            async for line in r.aiter_lines():
                if line:
                    delta = delta_of(DeltaLine.model_validate_json(line))
                    finished = delta.finish_reason is not None
                    if delta.error is not None:
                        delta.error = client_facing(delta.error, request_id)
                    yield delta
        if not finished:
            raise httpx.RemoteProtocolError("decode stream ended without a finish")
    except httpx.HTTPError as exc:
        state.metrics.backend_errors.labels(role="decode").inc()
        finished = True
        broken = errors.overloaded(f"decode instance {decode.url} failed: {exc!r}", 1)
        yield Delta([], [], "error", client_facing(broken, request_id))
    finally:
        decode.outstanding -= 1
        if not finished:
            await _abort(state, decode, request_id)
