"""The engine's HTTP server: health, pool report, metrics, the OpenAI API (combined role) and
the internal endpoints of the disaggregated roles."""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import errors
from .async_engine import AsyncEngine
from .detokenizer import Detokenizer
from .metrics import EngineMetrics
from .openai_api import (
    OpenAIOutput,
    chat_logprobs,
    chat_prompt,
    completion_prompt,
    new_app,
    respond,
    sampling_params,
)
from .protocol import ChatCompletionRequest, CompletionRequest
from .sequence import SamplingParams, is_terminal

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerState:
    """What the HTTP layer serves; `engine` is set once weights and pool are allocated."""

    role: str = "combined"
    internal_token: str | None = None
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    engine: AsyncEngine | None = None
    load_error: str | None = None
    started: float = field(default_factory=time.time)
    on_ready: list[Callable[[AsyncEngine], None]] = field(default_factory=list)

    def require_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise errors.not_ready()
        return self.engine

    def load_in_background(self, build: Callable[[EngineMetrics], AsyncEngine]) -> None:
        def run() -> None:
            try:
                engine = build(self.metrics)
                engine.start()
                for hook in self.on_ready:
                    hook(engine)
                self.engine = engine
                log.info("engine ready: %s", engine.engine.kvpool_report())
            except Exception as exc:  # reported on /readyz; the process stays up to say why
                log.exception("engine failed to start")
                self.load_error = f"{type(exc).__name__}: {exc}"

        threading.Thread(target=run, name="kvfence-loader", daemon=True).start()


def create_app(state: ServerState) -> FastAPI:
    app = new_app("kvfence engine")
    app.state.kvfence = state

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if state.engine is not None:
            return JSONResponse({"status": "ready"})
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)

    @app.get("/v1/kvpool")
    async def kvpool() -> dict[str, Any]:
        return state.require_engine().engine.kvpool_report()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = state.require_engine().engine
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.loaded.name,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "kvfence",
                    "max_model_len": engine.context_effective,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        engine = _combined(state)
        tokenizer = engine.engine.tokenizer
        prompt_ids = completion_prompt(body.prompt, tokenizer, engine.engine.config.vocab_size)
        params = sampling_params(body, logprobs=body.logprobs)
        return await _generate(engine, prompt_ids, params, body.max_tokens, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        engine = _combined(state)
        prompt_ids = chat_prompt(engine.engine.tokenizer, body)
        params = sampling_params(body, logprobs=chat_logprobs(body))
        return await _generate(engine, prompt_ids, params, body.token_limit(), body, request)

    if state.role in ("prefill", "decode"):
        from .internal_api import internal_router

        app.include_router(internal_router(state))
    return app


def _combined(state: ServerState) -> AsyncEngine:
    engine = state.require_engine()
    if state.role != "combined":
        raise errors.invalid_request(
            f"this engine runs the {state.role} role; send completions to the router"
        )
    return engine


async def _generate(
    engine: AsyncEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    max_tokens: int | None,
    body: CompletionRequest | ChatCompletionRequest,
    request: Request,
) -> Response:
    chat = isinstance(body, ChatCompletionRequest)
    seq = engine.admit(prompt_ids, params, max_tokens)
    if is_terminal(seq):  # rejected at admission: nothing was allocated
        assert seq.error is not None
        raise seq.error
    tokenizer = engine.engine.tokenizer
    out = OpenAIOutput(chat, engine.engine.loaded.name, tokenizer, len(prompt_ids))
    deltas = engine.stream(seq)
    first = await anext(deltas)
    detok = Detokenizer(tokenizer, body.stops())
    return await respond(first, deltas, out, detok, body, request.is_disconnected)
