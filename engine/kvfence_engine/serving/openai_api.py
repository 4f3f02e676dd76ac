"""The OpenAI-compatible surface shared by the engine and the router: request parsing, error
shape, and turning a stream of token deltas into completion / chat objects or SSE chunks."""

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvfence_engine.contracts import ErrorCode
from kvfence_engine.core import errors
from kvfence_engine.core.deltas import Delta
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import TokenLogprob
from kvfence_engine.loading.chat_prompt import chat_prompt_ids
from kvfence_engine.loading.detokenizer import Detokenizer
from kvfence_engine.loading.tokenizer import Tokenizer
from kvfence_engine.serving.limits import (
    BodyRefused,
    StartWatch,
    install_request_limits,
    refuse_unfittable_prompt,
)
from kvfence_engine.serving.protocol import ChatCompletionRequest, CompletionRequest, ErrorBody

log = logging.getLogger(__name__)


def error_response(error: EngineError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


# What an error status means, on any route that can answer it. Every route can answer 400 (a
# Content-Length that is no number), 408 (the body deadline), 413 (the body cap) and 500 (the
# catch-all).
ERROR_MEANINGS = {
    400: "the request is invalid: not JSON, a field out of range, a prompt over the context",
    401: "no API key, or an unknown one (the router with --api-keys); or, on an operational "
    "endpoint, no internal token",
    403: "an operational endpoint asked with a tenant's key, or switched off",
    404: "`model` names a model this server does not serve (model_not_found)",
    408: "the request body did not arrive within the body deadline (request_timeout)",
    409: "a pushed backends set older than the one in force (stale_backends)",
    413: "the request body is over --max-request-bytes (request_too_large)",
    422: "a pushed backends set that is not a valid backends file (invalid_backends)",
    429: "the tenant is at its limit of requests in flight or of the KV pool; see Retry-After",
    500: "an internal failure or a tripped isolation check, named by a request id",
    503: "loading, overloaded or no backend instance answered; see Retry-After",
}
ANY_ROUTE = (400, 408, 413, 500)
OPENAI_ERRORS = (400, 401, 404, 413, 429, 500, 503)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each with the OpenAI error body."""
    return {
        status: {"model": ErrorBody, "description": ERROR_MEANINGS[status]}
        for status in sorted({*ANY_ROUTE, *statuses})
    }


# One server-sent event: before OpenAPI 3.2 a text/event-stream `schema` describes each event
# (its fields as the SSE format names them), not the stream as one string.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}

# A completion answers JSON, or with "stream": true an event stream of JSON chunks.
COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the completion; with `stream: true`, server-sent events of chunks "
        "ending with `data: [DONE]`",
        "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}},
    },
    **error_responses(*OPENAI_ERRORS),
}


READYZ_RESPONSES: dict[int | str, dict[str, Any]] = {
    **error_responses(),
    503: {
        "description": 'not ready: `{"status": "loading" or "failed", "error": why}`',
        "content": {"application/json": {}},
    },
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    },
    **error_responses(401),
}


def new_app(title: str) -> FastAPI:
    """A FastAPI app with OpenAI-shaped errors, a request body cap, a liveness probe, and an
    OpenAPI schema that says so (400, never FastAPI's 422, for an invalid body)."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None)
    install_request_limits(app)
    install_error_handlers(app)  # added last, so its catch-all wraps the body cap too
    app.openapi = lambda: _schema_without_422(app)  # type: ignore[method-assign]

    @app.get("/healthz", responses=error_responses())
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _schema_without_422(app: FastAPI) -> dict[str, Any]:
    """FastAPI documents 422 for every route that takes input; ours answer 400 instead."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


class InternalErrors:
    """ASGI middleware, the catch-all: an exception that no handler turned into an answer
    becomes a JSON 500 in the OpenAI shape naming only a request id, and is logged, with its
    traceback, under that id. After the headers have gone nothing can be answered: it is logged
    and re-raised, so the server breaks the connection rather than end a truncated body
    cleanly."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        watched = StartWatch(send)
        try:
            await self.app(scope, receive, watched.send)
        except Exception:
            request_id = errors.new_incident()
            log.exception(
                "request id %s: %s %s failed%s",
                request_id,
                scope.get("method"),
                scope.get("path"),
                " after its response started" if watched.started else "",
            )
            if watched.started:
                raise
            await error_response(errors.internal_error(f"request id {request_id}"))(
                scope, receive, send
            )


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in the OpenAI shape; anything unexpected as a JSON 500."""
    app.add_middleware(InternalErrors)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        body, media = await request.body(), request.headers.get("content-type", "")
        return error_response(invalid_body(exc.errors(), body, media))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyRefused):
            return error_response(exc.error)
        return error_response(errors.http_error(exc.status_code, str(exc.detail)))


# What pydantic puts in an error's location for the branch of a union it tried ("str",
# "list[int]", "function-after[...]"): not a field the client sent, so never named.
_UNION_BRANCHES = {"str", "int", "float", "bool", "none", "list", "dict"}
# How many invalid fields an answer names: a body of 2,048 invalid messages is one short answer.
NAMED_FIELDS = 5


def field_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as the client wrote the field: `messages[0].content`."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _UNION_BRANCHES or "[" in str(part):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def invalid_body(problems: Sequence[Any], body: bytes = b"", media: str = "") -> EngineError:
    """A 400 saying in words what is wrong with a request body: that it is not JSON (where),
    not an object, or which fields failed validation and why. `param` is the first such
    field as the client wrote it (`messages[0].role`), None when the body as a whole is
    wrong. `media` is the request's Content-Type: a body sent as anything but JSON is not
    parsed, so the answer says to send JSON rather than that the JSON is wrong."""
    first = problems[0] if problems else {}
    if first.get("type") == "json_invalid":
        return errors.invalid_request(f"request body is not valid JSON: {_json_problem(body)}")
    by_field: dict[str, list[str]] = {}
    for problem in problems:
        loc = list(problem.get("loc", ()))
        where = field_path(loc[1:] if loc[:1] == ["body"] else loc)
        message = str(problem.get("msg", "invalid")).removeprefix("Value error, ")
        if problem.get("type") == "extra_forbidden":  # OpenAI's words (protocol.py, _Strict)
            message = f"Unrecognized request argument supplied: {loc[-1]}"
        messages = by_field.setdefault(where, [])
        if message not in messages:  # a union repeats a message per branch
            messages.append(message)
    if list(by_field) == [""]:  # the body itself, not a field of it
        if first.get("type") == "missing":
            return errors.invalid_request("request body is missing: send a JSON object")
        if body and media and "json" not in media.lower():
            return errors.invalid_request(
                f"request body is sent as {media.split(';')[0]}: send a JSON object as "
                "application/json"
            )
        return errors.invalid_request("request body is not a JSON object: send a JSON object")
    named = list(by_field.items())[:NAMED_FIELDS]
    message = "; ".join(
        f"{where or 'request body'}: {', or '.join(messages)}" for where, messages in named
    )
    if len(by_field) > NAMED_FIELDS:
        message += f"; and {len(by_field) - NAMED_FIELDS} more invalid fields"
    return errors.invalid_request(message, next(iter(by_field)) or None)


def _json_problem(body: bytes) -> str:
    try:
        json.loads(body)
    except json.JSONDecodeError as exc:
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    except UnicodeDecodeError as exc:
        return f"it is not UTF-8 (byte {exc.start})"
    return "it could not be parsed"  # pydantic's parser refused what json accepts


def prompt_field(body: CompletionRequest | ChatCompletionRequest) -> str:
    """The field the client sent its prompt in."""
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def naming_prompt_field(
    error: EngineError, body: CompletionRequest | ChatCompletionRequest
) -> EngineError:
    """An admission error about the prompt (over-long, from an engine that sees only token
    ids) with `param` naming the field the client sent it in."""
    if error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and error.param is None:
        return dataclasses.replace(error, param=prompt_field(body))
    return error


def check_model(requested: str | None, served: str) -> None:
    """404 model_not_found unless the request names the served model (or none). The served
    name is the only alias: the one GET /v1/models lists."""
    if requested is not None and requested != served:
        raise errors.model_not_found(requested, served)


def completion_prompt(
    prompt: str | list[int] | list[str], tokenizer: Tokenizer, vocab: int
) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode_prompt(prompt)
    if prompt and all(isinstance(p, int) for p in prompt):
        ids = [int(p) for p in prompt]
        if any(not 0 <= t < vocab for t in ids):
            raise errors.invalid_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        return ids
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return tokenizer.encode_prompt(prompt[0])
    raise errors.invalid_request("exactly one prompt per request is supported", "prompt")


@dataclass(slots=True)
class OpenAIOutput:
    """Formats one request's deltas as OpenAI completion or chat objects."""

    chat: bool
    model: str
    tokenizer: Tokenizer
    prompt_tokens: int
    id: str = ""  # OpenAI's shape: "chatcmpl-..." or "cmpl-...", shared by a stream's chunks
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from this tenant's prefix cache

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def logprobs(self, items: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if not items:
            return None
        text = self.tokenizer.token_text
        if self.chat:
            return {
                "content": [
                    {
                        "token": text(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(text(lp.token_id).encode()),
                        "top_logprobs": [
                            {"token": text(t), "logprob": v, "bytes": list(text(t).encode())}
                            for t, v in lp.top
                        ],
                    }
                    for lp in items
                ]
            }
        offsets, pos = [], offset
        for lp in items:
            offsets.append(pos)
            pos += len(text(lp.token_id))
        return {
            "tokens": [text(lp.token_id) for lp in items],
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{text(t): v for t, v in lp.top} for lp in items],
            "text_offset": offsets,
        }

    def _object(
        self,
        kind: str,
        content: dict[str, Any],
        logprobs: dict[str, Any] | None,
        finish: str | None,
    ) -> dict[str, Any]:
        choice = {"index": 0, **content, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def chunk(
        self, text: str, logprobs: dict[str, Any] | None, finish: str | None, first: bool = False
    ) -> dict[str, Any]:
        if not self.chat:
            return self._object("text_completion", {"text": text}, logprobs, finish)
        delta = (
            {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        )
        return self._object("chat.completion.chunk", {"delta": delta}, logprobs, finish)

    def whole(self, text: str, logprobs: dict[str, Any] | None, finish: str) -> dict[str, Any]:
        if self.chat:
            content = {"message": {"role": "assistant", "content": text}}
            body = self._object("chat.completion", content, logprobs, finish)
        else:
            body = self._object("text_completion", {"text": text}, logprobs, finish)
        return body | {"usage": self.usage()}


def chat_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The chat template's markup as control tokens, every message's content as text."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        return chat_prompt_ids(tokenizer, messages)
    except Exception as exc:
        raise errors.invalid_request(f"cannot apply the chat template: {exc}", "messages") from exc


async def tokenized_prompt(
    body: CompletionRequest | ChatCompletionRequest,
    tokenizer: Tokenizer,
    context: int,
    vocab: int,
    rejected: Counter,
) -> list[int]:
    """The body's prompt as token ids: refused untokenized (counted in `rejected`) if its
    characters cannot fit in `context`, else tokenized on a worker thread, a chat through the
    chat template; ids outside [0, vocab) are refused."""
    refuse_unfittable_prompt(body, tokenizer, context, rejected)
    if isinstance(body, ChatCompletionRequest):
        return await asyncio.to_thread(chat_prompt, tokenizer, body)
    return await asyncio.to_thread(completion_prompt, body.prompt, tokenizer, vocab)


async def _close(deltas: AsyncIterator[Delta]) -> None:
    aclose = getattr(deltas, "aclose", None)
    if aclose is not None:
        await aclose()


async def respond(
    first: Delta,
    deltas: AsyncIterator[Delta],
    out: "OpenAIOutput",
    body: CompletionRequest | ChatCompletionRequest,
    client_gone: Callable[[], Awaitable[bool]] | None = None,
) -> Response:
    """Turn a request's deltas into an OpenAI response, streaming or whole. `first` is the
    first delta, awaited before the status code is chosen, so a request that fails before its
    first token gets its real HTTP status rather than a 200 stream. A whole (non-streamed)
    response stops generating when `client_gone` says the client left (a stream notices by
    itself)."""
    if first.error is not None:
        await _close(deltas)
        return error_response(first.error)
    detok = Detokenizer(out.tokenizer, body.stops())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(out, detok, first, deltas, include_usage), media_type="text/event-stream"
        )
    text, items, finish = "", [], "length"
    async for delta in _with_first(first, deltas):
        if delta.error is not None:
            return error_response(delta.error)
        if client_gone is not None and await client_gone():
            await _close(deltas)  # aborts the request: nobody will read the answer
            return Response(status_code=499)
        out.completion_tokens += len(delta.token_ids)
        text += detok.push(delta.token_ids, final=delta.finish_reason is not None)
        items += delta.logprobs
        if detok.stopped:
            finish = "stop"
            break
        if delta.finish_reason is not None:
            finish = delta.finish_reason
    await _close(deltas)
    return JSONResponse(out.whole(text, out.logprobs(items, 0), finish))


async def _with_first(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield first
    if first.finish_reason is None:
        async for delta in rest:
            yield delta


def _sse_event(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _sse(
    out: OpenAIOutput,
    detok: Detokenizer,
    first: Delta,
    deltas: AsyncIterator[Delta],
    include_usage: bool,
) -> AsyncIterator[str]:
    emitted = 0
    try:
        if out.chat:
            yield _sse_event(out.chunk("", None, None, first=True))
        async for delta in _with_first(first, deltas):
            if delta.error is not None:
                # Headers are gone; end the stream with an error event (no foreign tokens
                # were produced: the failing step generated nothing).
                yield _sse_event(delta.error.body())
                return
            out.completion_tokens += len(delta.token_ids)
            finish = delta.finish_reason
            text = detok.push(delta.token_ids, final=finish is not None)
            if detok.stopped:
                finish = "stop"
            logprobs = out.logprobs(delta.logprobs, emitted)
            emitted += len(text)
            if text or logprobs or finish:
                yield _sse_event(out.chunk(text, logprobs, finish))
            if finish is not None:
                break
        if include_usage:
            usage_chunk = out.chunk("", None, None)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = out.usage()
            yield _sse_event(usage_chunk)
        yield _sse_event("[DONE]")
    finally:
        await _close(deltas)  # aborts the request if it is still running
