"""Bounded work before authentication and tokenization, on the engine and the router alike.

- The body cap: `BodyLimit`, an ASGI middleware that `new_app` installs, answers a body over
  --max-request-bytes with 413 request_too_large before reading it: a declared Content-Length
  is judged from the header alone, a chunked body is read only up to the cap.
- The character cap: `refuse_unfittable_prompt` answers a prompt with more characters than the
  context can hold at the tokenizer's longest token (`Tokenizer.chars_per_token`) with 400
  context_length_exceeded, without tokenizing it.
- Tokenization itself runs on a worker thread (the completion and chat handlers call
  `asyncio.to_thread`) and `Tokenizer.encode` releases the GIL, so the event loop goes on
  answering /healthz and other tenants while a long prompt is tokenized.
"""

from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence_engine.contracts import ErrorCode
from kvfence_engine.core import errors
from kvfence_engine.core.errors import EngineError
from kvfence_engine.loading.tokenizer import Tokenizer
from kvfence_engine.serving.protocol import ChatCompletionRequest, CompletionRequest

# A full context's prompt fits at up to about 9 bytes a token (English text is about 4,
# JSON-escaped CJK 6 to 9, a token id list up to 7): any context up to about 450,000 tokens.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


@dataclass(slots=True)
class RequestLimits:
    """What `BodyLimit` enforces; the command line sets it after the app is built."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def install_request_limits(app: FastAPI) -> None:
    app.state.request_limits = RequestLimits()
    app.add_middleware(BodyLimit, limits=app.state.request_limits)


def set_max_request_bytes(app: FastAPI, max_request_bytes: int) -> None:
    app.state.request_limits.max_request_bytes = max_request_bytes


class BodyLimit:
    """Refuses a request body over `limits.max_request_bytes` with 413 before the app (body
    parsing, authentication, tokenization) sees it, reading at most one chunk past the cap."""

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
        elif isinstance(declared, int):
            if declared > limit:  # not one byte of it read
                await _answer(errors.request_too_large(limit, declared), scope, receive, send)
            else:  # the server hands the app no more than the declared length
                await self.app(scope, receive, send)
        else:  # chunked: read up to the limit, then hand the app what was read
            read: list[Message] = []
            size = 0
            while not read or _more_body(read[-1]):
                read.append(await receive())
                size += len(read[-1].get("body", b""))
                if size > limit:
                    await _answer(errors.request_too_large(limit, None), scope, receive, send)
                    return
            await self.app(scope, _replay(iter(read), receive), send)


def _content_length(scope: Scope) -> int | str | None:
    """The declared body length; None if there is none, "invalid" if it is not a number."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else "invalid"
    return None


def _more_body(message: Message) -> bool:
    return message["type"] == "http.request" and bool(message.get("more_body", False))


def _replay(read: Iterator[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return next(read, None) or await receive()

    return replayed


async def _answer(error: EngineError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


def refuse_unfittable_prompt(
    body: CompletionRequest | ChatCompletionRequest,
    tokenizer: Tokenizer,
    context: int,
    rejected: Counter,
) -> None:
    """400 context_length_exceeded, counted in `rejected`, for a text prompt (chat: all
    messages' content) of more characters than `context` tokens can stand for; it is not
    tokenized. Token id lists are counted exactly at admission."""
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
