"""Bounded work before authentication and tokenization, on the engine and the router alike.

- Authentication first: a route that needs a key or a token checks it on the headers alone,
  before one byte of the body is read (`serving/gate.py`).
- The body cap: `BodyLimit`, an ASGI middleware that `new_app` installs, answers a body over
  --max-request-bytes with 413 request_too_large: a declared Content-Length is judged from the
  header alone, before the app runs; a chunked body as the app reads it, never past one chunk
  beyond the cap. It reads nothing by itself, so a body the app never asks for (a request
  refused on its headers) is never kept.
- The body deadline: the body must have arrived within `RequestLimits.body_seconds` of its
  headers, or the app's read fails with 408 request_timeout. What it reads arrives in pieces
  of up to `COALESCE_BYTES`, joined, so a body sent a byte at a time costs a byte a byte.
  (Headers have their deadline in `serving/connections.py`.)
- Bounded parsing: pydantic stops at the first list over its `max_length` (protocol.py), and an
  invalid body's error names at most `invalid_body`'s first few fields.
- The character cap: `refuse_unfittable_prompt` answers a prompt with more characters than the
  context can hold at the tokenizer's longest token (`Tokenizer.chars_per_token`), or with more
  chat messages than the context has tokens, with 400 context_length_exceeded, without
  tokenizing it.
- Tokenization itself runs on a worker thread (the completion and chat handlers call
  `asyncio.to_thread`) and `Tokenizer.encode` releases the GIL, so the event loop goes on
  answering /healthz and other tenants while a long prompt is tokenized.
"""

import asyncio
import time
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence_engine.contracts import ErrorCode
from kvfence_engine.core import errors
from kvfence_engine.core.errors import EngineError
from kvfence_engine.loading.tokenizer import Tokenizer
from kvfence_engine.serving.protocol import ChatCompletionRequest, CompletionRequest

# A full context's prompt fits at up to about 9 bytes a token (English text is about 4,
# JSON-escaped CJK 6 to 9, a token id list up to 7): any context up to about 450,000 tokens.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# The cap's whole body at 1 Mbit/s takes about 34 s.
DEFAULT_BODY_SECONDS = 60.0
# What one read of the body hands the app at most: the server's own read buffer (uvicorn's
# flow control pauses the socket above 64 KiB).
COALESCE_BYTES = 64 * 1024


@dataclass(slots=True)
class RequestLimits:
    """What `BodyLimit` enforces; the command line sets it after the app is built."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_seconds: float = DEFAULT_BODY_SECONDS


def install_request_limits(app: FastAPI) -> None:
    app.state.request_limits = RequestLimits()
    app.add_middleware(BodyLimit, limits=app.state.request_limits)


def set_request_limits(
    app: FastAPI, max_request_bytes: int, body_seconds: float = DEFAULT_BODY_SECONDS
) -> None:
    app.state.request_limits.max_request_bytes = max_request_bytes
    app.state.request_limits.body_seconds = body_seconds


class BodyRefused(HTTPException):
    """Raised from the app's read of its body (over the cap, past the deadline): the error
    handlers answer `error`. An HTTPException, so that FastAPI's own body reading passes it on
    rather than answering 400 "error parsing the body"."""

    def __init__(self, error: EngineError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


class StartWatch:
    """An ASGI `send` that remembers whether the response has started: until it has, a
    middleware may still answer with an error of its own; after, nothing can be answered."""

    __slots__ = ("_send", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def send(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)


class BodyLimit:
    """Refuses a request body over `limits.max_request_bytes` (413), or slower than
    `limits.body_seconds` (408), reading only what the app asks for."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_request_bytes
        declared = _content_length(scope)
        if declared == "invalid":
            error = errors.invalid_request("invalid Content-Length header")
            await _answer(error, scope, receive, send)
        elif isinstance(declared, int) and declared > limit:  # not one byte of it read
            await _answer(errors.request_too_large(limit, declared), scope, receive, send)
        else:
            deadline = time.monotonic() + self.limits.body_seconds
            body = _BoundedBody(receive, limit, deadline)
            watched = StartWatch(send)
            try:
                await self.app(scope, body.receive, watched.send)
            except BodyRefused as exc:  # an app without the error handlers (FastAPI's answer)
                if watched.started:
                    raise
                await _answer(exc.error, scope, receive, send)


class _BoundedBody:
    """The app's receive: the body in joined pieces, within the cap and the deadline."""

    def __init__(self, receive: Receive, limit: int, deadline: float) -> None:
        self._receive = receive
        self._limit = limit
        self._deadline = deadline
        self._size = 0
        self._complete = False

    async def receive(self) -> Message:
        if self._complete:  # after the body: disconnects, for the app's disconnect checks
            return await self._receive()
        piece = bytearray()
        try:
            async with asyncio.timeout(max(0.0, self._deadline - time.monotonic())):
                while True:
                    message = await self._receive()
                    if message["type"] != "http.request":
                        return message  # the client left: what it sent no longer matters
                    piece += message.get("body", b"")
                    self._size += len(message.get("body", b""))
                    if self._size > self._limit:
                        raise BodyRefused(errors.request_too_large(self._limit, None))
                    more = bool(message.get("more_body", False))
                    if not more or len(piece) >= COALESCE_BYTES:
                        break
        except TimeoutError:
            raise BodyRefused(errors.request_timeout(self._size)) from None
        self._complete = not more
        return {"type": "http.request", "body": bytes(piece), "more_body": more}


def _content_length(scope: Scope) -> int | str | None:
    """The declared body length; None if there is none, "invalid" if it is not a number."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else "invalid"
    return None


async def _answer(error: EngineError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


def refuse_unfittable_prompt(
    body: CompletionRequest | ChatCompletionRequest,
    tokenizer: Tokenizer,
    context: int,
    rejected: Counter,
) -> None:
    """400 context_length_exceeded, counted in `rejected`, for a text prompt (chat: all
    messages' content) of more characters than `context` tokens can stand for, or a chat of
    more messages than `context` has tokens (each message's markup is a token at least, so the
    check holds for empty messages too); it is not tokenized. Token id lists are counted
    exactly at admission."""
    if isinstance(body, ChatCompletionRequest) and len(body.messages) > context:
        rejected.labels(reason=ErrorCode.CONTEXT_LENGTH_EXCEEDED).inc()
        raise errors.too_many_messages(len(body.messages), context)
    if tokenizer.chars_per_token is None:
        return
    if isinstance(body, ChatCompletionRequest):
        chars, param = sum(len(m.text()) for m in body.messages), "messages"
    else:
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        chars, param = sum(len(t) for t in texts if isinstance(t, str)), "prompt"
    limit = context * tokenizer.chars_per_token
    if chars > limit:
        rejected.labels(reason=ErrorCode.CONTEXT_LENGTH_EXCEEDED).inc()
        raise errors.unfittable_prompt(chars, context, tokenizer.chars_per_token, param)
