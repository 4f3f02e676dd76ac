"""The engine's HTTP server: health, pool report, metrics and the OpenAI API (combined role).
The disaggregated roles add the internal endpoints (kvfence_engine.disagg.internal_api).

With an internal token (--internal-token-file) the pool report and the metrics are for the
operator, the router and Prometheus only: they show pool occupancy and every request's
counts. Prometheus presents the metrics token (--metrics-token-sha256), which opens /metrics and
nothing else. /healthz and /readyz stay open for the kubelet's probes."""

import logging
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfence_engine.auth import presents_internal_token, presents_metrics_token
from kvfence_engine.contracts import (
    EngineReadiness,
    KvPoolReport,
    LoadReport,
    Role,
    UnsafeFaultsOn,
    UnsafeFaultSwitch,
)
from kvfence_engine.core import errors
from kvfence_engine.core.faults import UnsafeFaultRefused, runtime_fault
from kvfence_engine.core.request import SamplingParams, is_terminal
from kvfence_engine.loading.tokenizer import tokenizer_data
from kvfence_engine.serving.async_engine import AsyncEngine
from kvfence_engine.serving.openai_api import (
    COMPLETION_RESPONSES,
    METRICS_RESPONSES,
    OPENAI_ERRORS,
    READYZ_RESPONSES,
    OpenAIOutput,
    check_model,
    error_responses,
    naming_prompt_field,
    new_app,
    respond,
    tokenized_prompt,
)
from kvfence_engine.serving.protocol import ChatCompletionRequest, CompletionRequest, sampling_of
from kvfence_engine.serving.state import ServerState
from kvfence_engine.tools.progress import current as loading_progress

log = logging.getLogger(__name__)


def create_app(state: ServerState) -> FastAPI:
    app = new_app("kvfence engine")
    app.state.kvfence = state

    def operational(request: Request) -> None:
        """The internal token, when the engine has one (a lone engine on a laptop has none)."""
        token = state.internal_token
        if token is not None and not presents_internal_token(request.headers, token):
            raise errors.internal_token_required(request.url.path)

    def scraper(request: Request) -> None:
        """The metrics token (Prometheus's), or whatever `operational` accepts."""
        if not presents_metrics_token(request.headers, state.metrics_token_sha256):
            operational(request)

    @app.get("/readyz", responses=READYZ_RESPONSES)
    async def readyz() -> JSONResponse:
        if state.engine is not None:
            return JSONResponse({"status": "ready"})
        report = (
            EngineReadiness(status="failed", error=state.load_error)
            if state.load_error
            else EngineReadiness(status="loading", progress=loading_progress())
        )
        return JSONResponse(report.model_dump(mode="json"), status_code=503)

    @app.get("/v1/kvpool", dependencies=[Depends(operational)], responses=error_responses(401, 503))
    async def kvpool() -> KvPoolReport:
        return state.require_engine().engine.kvpool_report()

    @app.get("/v1/load", dependencies=[Depends(operational)], responses=error_responses(401, 503))
    async def load() -> LoadReport:
        """The engine's load and its latencies over the last minute (autoscaling's signals)."""
        return state.require_engine().engine.load_report()

    @app.get(
        "/internal/v1/tokenizer",
        dependencies=[Depends(operational)],
        responses=error_responses(401, 503),
    )
    async def tokenizer() -> dict[str, Any]:
        """The model's tokenizer, for a router that has no model volume (`kvfence router
        --tokenizer-from-engines`): tokenizer_data, with the model's name and source."""
        engine = state.require_engine().engine
        report = engine.kvpool_report()
        return {
            "model_name": report.model_name,
            "model_source": report.model_source,
            "tokenizer": tokenizer_data(engine.tokenizer),
        }

    @app.post(
        "/internal/unsafe-fault",
        dependencies=[Depends(operational)],
        responses=error_responses(400, 401, 403, 503),
    )
    async def unsafe_fault(body: UnsafeFaultSwitch) -> UnsafeFaultsOn:
        """Test-only: switch a fault on in this running engine (core/faults.py::RUNTIME), as
        a node that goes bad after its rollout would; refused (403) unless the engine runs
        with KVFENCE_ALLOW_UNSAFE=1. The standing canary's negative control."""
        try:
            fault = runtime_fault(body.fault)
        except PermissionError as exc:
            raise errors.forbidden(str(exc)) from None
        except UnsafeFaultRefused as exc:
            raise errors.invalid_request(str(exc), "fault") from None
        engine = state.require_engine()
        await engine.call(lambda: engine.engine.switch_on(fault))
        report = engine.engine.kvpool_report()
        return UnsafeFaultsOn(unsafe_faults=report.unsafe_faults)

    @app.get("/metrics", dependencies=[Depends(scraper)], responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=error_responses(*OPENAI_ERRORS))
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

    @app.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _complete(state, body, request)

    @app.post("/v1/chat/completions", responses=COMPLETION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _complete(state, body, request)

    return app


def _combined(state: ServerState) -> AsyncEngine:
    engine = state.require_engine()
    if state.role != Role.COMBINED:
        raise errors.invalid_request(
            f"this engine runs the {state.role} role; send completions to the router"
        )
    return engine


async def _complete(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest, request: Request
) -> Response:
    """Both completion routes: the prompt through the step loop, its deltas as the answer."""
    engine = _combined(state)
    llm = engine.engine
    check_model(body.model, llm.loaded.name)
    rejected = state.metrics.rejected
    vocab = llm.config.vocab_size
    prompt_ids = await tokenized_prompt(body, llm.tokenizer, llm.context_effective, vocab, rejected)
    params = SamplingParams.of(sampling_of(body))
    seq = engine.admit(prompt_ids, params, body.token_limit(), cache_salt=body.cache_salt)
    if is_terminal(seq):  # rejected at admission: nothing was allocated
        assert seq.error is not None
        raise naming_prompt_field(seq.error, body)
    chat = isinstance(body, ChatCompletionRequest)
    out = OpenAIOutput(chat, llm.loaded.name, llm.tokenizer, len(prompt_ids))
    deltas = engine.stream(seq)
    first = await anext(deltas)
    out.cached_tokens = seq.cached_tokens  # decided by the prefill that gave the first token
    return await respond(first, deltas, out, body, request.is_disconnected)
