"""Errors the engine reports to clients, in the OpenAI error shape."""

import uuid
from dataclasses import dataclass


@dataclass(eq=False)
class EngineError(Exception):
    """A request-level failure with the HTTP status and OpenAI error fields it maps to.

    Not frozen: frameworks set __traceback__ on exceptions they handle."""

    status: int
    message: str
    type: str
    code: str
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


def context_length_exceeded(
    prompt_tokens: int, limit: int, what: str, param: str | None = None
) -> EngineError:
    """`param` is the field the client sent the prompt in ("prompt" or "messages"); the
    engine's admission, which sees only token ids, leaves it to the API layer."""
    return EngineError(
        400,
        f"This model's maximum context length is {limit} tokens ({what}); your prompt has "
        f"{prompt_tokens} tokens. Shorten the prompt.",
        "invalid_request_error",
        "context_length_exceeded",
        param,
    )


def model_not_found(requested: str, served: str) -> EngineError:
    """OpenAI's answer (and vLLM's) to a `model` the server does not serve."""
    return EngineError(
        404,
        f"The model `{requested}` does not exist or you do not have access to it; "
        f"this server serves `{served}` (GET /v1/models).",
        "invalid_request_error",
        "model_not_found",
        "model",
    )


def invalid_request(message: str, param: str | None = None) -> EngineError:
    return EngineError(400, message, "invalid_request_error", "invalid_request", param)


def overloaded(message: str, retry_after: int = 1) -> EngineError:
    return EngineError(503, message, "server_error", "overloaded", None, retry_after)


# A tenant over its own limit gets 429 with Retry-After, typed as OpenAI types its rate limits:
# "requests" for a limit on requests, "tokens" for one on tokens (here: KV pages).
TENANT_RETRY_AFTER = 1


def tenant_limit(message: str) -> EngineError:
    """The router: the tenant already has its most concurrent requests in flight."""
    return EngineError(429, message, "requests", "tenant_limit", None, TENANT_RETRY_AFTER)


def tenant_pool_share(message: str) -> EngineError:
    """An engine: the tenant's requests already reserve its share of the KV pool."""
    return EngineError(429, message, "tokens", "tenant_pool_share", None, TENANT_RETRY_AFTER)


def internal_token_required(path: str) -> EngineError:
    """An operational endpoint (/metrics, /v1/kvpool) asked for without the internal token."""
    return EngineError(
        401,
        f"{path} needs the internal token (X-Kvfence-Internal-Token or Authorization: Bearer)",
        "authentication_error",
        "unauthorized",
    )


def new_incident() -> str:
    """A short random id for one internal failure, for the client's message and the log."""
    return uuid.uuid4().hex[:16]


def internal_error(reference: str) -> EngineError:
    """A failure inside kvfence. The message names no internals (no exception text, no
    address): only a reference that the server's log line, with the traceback, carries too."""
    return EngineError(500, f"internal error ({reference})", "server_error", "internal_error")


def not_ready() -> EngineError:
    return EngineError(
        503,
        "the engine is still loading weights or allocating its KV pool",
        "server_error",
        "not_ready",
        None,
        2,
    )


def isolation_violation(detail: str) -> EngineError:
    return EngineError(
        500,
        "The request was stopped before generating from KV cache it does not own "
        f"({detail}). No output was produced from that data.",
        "server_error",
        "kv_isolation_violation",
    )
