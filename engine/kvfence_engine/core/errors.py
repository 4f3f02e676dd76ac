"""Errors the engine reports to clients, in the OpenAI error shape.

Every error is built by one of the factories below, which fix its status, type and code, and
its code is a contracts.ErrorCode (codes cross process boundaries): compared as a member, never
as a string. A StrEnum member is its value wherever it is written (JSON, a log line, a metric
label), so the `code` an OpenAI client reads is the string it always was."""

import uuid
from dataclasses import dataclass

from kvfence_engine.contracts import ErrorCode


@dataclass(eq=False)
class EngineError(Exception):
    """A request-level failure with the HTTP status and OpenAI error fields it maps to.

    Not frozen: frameworks set __traceback__ on exceptions they handle."""

    status: int
    message: str
    type: str
    code: ErrorCode
    param: str | None = None
    retry_after: int | None = None

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


# --- the request ----------------------------------------------------------------------------


def invalid_request(message: str, param: str | None = None) -> EngineError:
    return EngineError(400, message, "invalid_request_error", ErrorCode.INVALID_REQUEST, param)


def context_length_exceeded(
    prompt_tokens: int, limit: int, what: str, param: str | None = None
) -> EngineError:
    """`param` is the field the client sent the prompt in ("prompt" or "messages"); the
    engine's admission, which sees only token ids, leaves it to the API layer."""
    return _too_long(
        f"This model's maximum context length is {limit} tokens ({what}); your prompt has "
        f"{prompt_tokens} tokens. Shorten the prompt.",
        param,
    )


def unfittable_prompt(chars: int, context: int, chars_per_token: int, param: str) -> EngineError:
    """A text prompt refused before it is tokenized: more characters than `context` tokens of
    at most `chars_per_token` characters each can hold."""
    return _too_long(
        f"This model's maximum context length is {context} tokens; your prompt has "
        f"{chars} characters, more than {context} tokens can hold (at most "
        f"{chars_per_token} characters each). Shorten the prompt.",
        param,
    )


def too_many_messages(messages: int, context: int) -> EngineError:
    """A chat refused before its template is applied: each message's markup is a token at
    least, so more messages than the context has tokens cannot fit."""
    return _too_long(
        f"This model's maximum context length is {context} tokens; your chat has {messages} "
        "messages, each at least one token. Send fewer messages.",
        "messages",
    )


def _too_long(message: str, param: str | None) -> EngineError:
    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    return EngineError(400, message, "invalid_request_error", code, param)


def model_not_found(requested: str, served: str) -> EngineError:
    """OpenAI's answer (and vLLM's) to a `model` the server does not serve."""
    return EngineError(
        404,
        f"The model `{requested}` does not exist or you do not have access to it; "
        f"this server serves `{served}` (GET /v1/models).",
        "invalid_request_error",
        ErrorCode.MODEL_NOT_FOUND,
        "model",
    )


def request_too_large(limit: int, size: int | None) -> EngineError:
    """A body over --max-request-bytes; `size` is its declared length, None if chunked."""
    what = "The request body" if size is None else f"The request body ({size} bytes)"
    return EngineError(
        413,
        f"{what} is larger than this server accepts (at most {limit} bytes). Send a shorter "
        "prompt.",
        "invalid_request_error",
        ErrorCode.REQUEST_TOO_LARGE,
    )


def request_timeout(received: int) -> EngineError:
    """A body that did not arrive within the body deadline (serving/limits.py)."""
    return EngineError(
        408,
        f"The request body did not arrive in time ({received} bytes received); send it whole, "
        "without pauses.",
        "invalid_request_error",
        ErrorCode.REQUEST_TIMEOUT,
    )


def http_error(status: int, detail: str) -> EngineError:
    """What the HTTP framework refuses by itself: no such route (404), a method it does not
    take (405), ..."""
    code = ErrorCode.NOT_FOUND if status == 404 else ErrorCode.HTTP_ERROR
    return EngineError(status, detail, "invalid_request_error", code)


# --- who asks -------------------------------------------------------------------------------


def invalid_api_key() -> EngineError:
    """The router with --api-keys: no key, or one no keys file names."""
    return EngineError(
        401, "missing or invalid API key", "invalid_request_error", ErrorCode.INVALID_API_KEY
    )


def unauthorized(message: str) -> EngineError:
    """No internal token, or a wrong one, where one is needed."""
    return EngineError(401, message, "authentication_error", ErrorCode.UNAUTHORIZED)


def internal_token_required(path: str) -> EngineError:
    """An operational endpoint (/metrics, /v1/kvpool) asked for without the internal token."""
    return unauthorized(
        f"{path} needs the internal token (X-Kvfence-Internal-Token or Authorization: Bearer)"
    )


def forbidden(message: str) -> EngineError:
    """An operational endpoint asked for with a tenant's key, or switched off."""
    return EngineError(403, message, "permission_error", ErrorCode.FORBIDDEN)


# --- limits: retry later --------------------------------------------------------------------


def overloaded(message: str, retry_after: int = 1) -> EngineError:
    return EngineError(503, message, "server_error", ErrorCode.OVERLOADED, None, retry_after)


def not_ready(
    message: str = "the engine is still loading weights or allocating its KV pool",
) -> EngineError:
    return EngineError(503, message, "server_error", ErrorCode.NOT_READY, None, 2)


# A tenant over its own limit gets 429 with Retry-After, typed as OpenAI types its rate limits:
# "requests" for a limit on requests, "tokens" for one on tokens (here: KV pages).
TENANT_RETRY_AFTER = 1


def tenant_limit(message: str) -> EngineError:
    """The router: the tenant already has its most concurrent requests in flight."""
    code = ErrorCode.TENANT_LIMIT
    return EngineError(429, message, "requests", code, None, TENANT_RETRY_AFTER)


def tenant_pool_share(message: str) -> EngineError:
    """An engine: the tenant's requests already reserve its share of the KV pool."""
    code = ErrorCode.TENANT_POOL_SHARE
    return EngineError(429, message, "tokens", code, None, TENANT_RETRY_AFTER)


# --- failures inside kvfence ----------------------------------------------------------------


def new_incident() -> str:
    """A short random id for one internal failure, for the client's message and the log."""
    return uuid.uuid4().hex[:16]


def internal_error(reference: str) -> EngineError:
    """A failure inside kvfence. The message names no internals (no exception text, no
    address): only a reference that the server's log line, with the traceback, carries too."""
    return EngineError(
        500, f"internal error ({reference})", "server_error", ErrorCode.INTERNAL_ERROR
    )


def isolation_violation(detail: str) -> EngineError:
    return EngineError(
        500,
        "The request was stopped before generating from KV cache it does not own "
        f"({detail}). No output was produced from that data.",
        "server_error",
        ErrorCode.KV_ISOLATION_VIOLATION,
    )


# --- the router and its backends ------------------------------------------------------------


def backend_unreachable(message: str) -> EngineError:
    """An instance that did not answer at all (refused, reset, timed out), or answered as no
    instance of this deployment would."""
    return EngineError(503, message, "server_error", ErrorCode.BACKEND_UNREACHABLE, None, 1)


def bad_gateway(status: int) -> EngineError:
    """A backend's error answer that is not an error body kvfence writes."""
    return EngineError(502, f"backend answered {status}", "server_error", ErrorCode.BAD_GATEWAY)


def relayed(
    status: int,
    message: str,
    type: str,
    code: ErrorCode,
    param: str | None = None,
    retry_after: int | None = None,
) -> EngineError:
    """An error another kvfence process reported (an engine's error body, a decode stream's
    `WireError`), as it reported it."""
    return EngineError(status, message, type, code, param, retry_after)


def stale_backends(message: str) -> EngineError:
    """A pushed backends set older than the one in force."""
    return EngineError(409, message, "invalid_request_error", ErrorCode.STALE_BACKENDS)


def invalid_backends(message: str, param: str | None = None) -> EngineError:
    """A pushed backends set that is not a valid backends file."""
    code = ErrorCode.INVALID_BACKENDS
    return EngineError(422, message, "invalid_request_error", code, param)


# --- the internal API and the KV transfer ---------------------------------------------------


def wrong_role(message: str) -> EngineError:
    """An internal endpoint of the other role (a decode listed as prefill)."""
    return EngineError(404, message, "invalid_request_error", ErrorCode.WRONG_ROLE)


def unknown_request(message: str) -> EngineError:
    """No reservation by that id: never made, expired or aborted."""
    return EngineError(404, message, "invalid_request_error", ErrorCode.UNKNOWN_REQUEST)


def reservation_expired() -> EngineError:
    return EngineError(
        408,
        "no KV arrived for the reservation in time",
        "server_error",
        ErrorCode.RESERVATION_EXPIRED,
    )


def handle_mismatch() -> EngineError:
    return EngineError(
        400,
        "the transfer's pages and tags are not the reservation's",
        "invalid_request_error",
        ErrorCode.HANDLE_MISMATCH,
    )


def duplicate_transfer() -> EngineError:
    return EngineError(
        409,
        "this reservation already received its transfer",
        "invalid_request_error",
        ErrorCode.DUPLICATE_TRANSFER,
    )


def transfer_failed(
    message: str, code: ErrorCode = ErrorCode.TRANSFER_FAILED, status: int = 502
) -> EngineError:
    """A KV transfer that did not complete; `code` says why (a TransferError's code)."""
    return EngineError(status, message, "server_error", code)
