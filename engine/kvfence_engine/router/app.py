"""The router's HTTP routes: the OpenAI front of a disaggregated deployment, thin handlers
over its state (router/state.py: tenants, auth, tokenizer, served context), the relay protocol
(router/relay.py: reserve, prefill, decode, abort) and the views of its backends
(router/pool_views.py: /v1/kvpool, the backends' counters on /metrics).

What a tenant sees (issue 12, finding 4): its own answers, the served context, each engine's
role and pool size. Not other tenants' names or counts (/metrics needs the internal token or
Prometheus's metrics token), not where the engines are (the tenant's /v1/kvpool names no URL
or port, and a backend's server-side error reaches the client as a generic message; the detail
goes to the log under the request id), not how full the pools are.
"""

import logging
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError

from kvfence_engine.auth import presents_metrics_token
from kvfence_engine.contracts import (
    BackendsFile,
    BackendsInForce,
    KvPoolReport,
    RouterPoolSummary,
    TenantPoolSummary,
    TenantRequests,
)
from kvfence_engine.core import errors
from kvfence_engine.router.backends import StalePush
from kvfence_engine.router.pool_views import (
    BackendCounters,
    read_backends,
    summarise_pools,
    tenant_view,
)
from kvfence_engine.router.relay import in_flight, relay
from kvfence_engine.router.request_counts import RequestCounts
from kvfence_engine.router.state import RouterState
from kvfence_engine.router.tenants import Slot
from kvfence_engine.serving.gate import checked_first
from kvfence_engine.serving.openai_api import (
    COMPLETION_RESPONSES,
    METRICS_RESPONSES,
    OPENAI_ERRORS,
    READYZ_RESPONSES,
    check_model,
    error_responses,
    invalid_body,
    new_app,
    tokenized_prompt,
)
from kvfence_engine.serving.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)
# PUT's body, read by hand so that the token is checked before the body and a bad body is a
# 422 (FastAPI would check the body first, as a 400); the response model puts it in components.
PUSH_SCHEMA = {"$ref": "#/components/schemas/BackendsFile"}
# The router has no model, only its tokenizer: it refuses a token id no vocabulary could hold,
# and decode's admission the ids its model's does not.
ANY_TOKEN_ID = 1 << 31


def create_router_app(state: RouterState) -> FastAPI:
    app = new_app("kvfence router")
    # outside every other middleware: it counts their refusals too (the body cap's 413)
    app.add_middleware(
        RequestCounts,
        tenant_of=state.tenant_label,
        requests=state.metrics.requests,
        activity=state.activity,
    )

    @app.get("/readyz", responses=READYZ_RESPONSES)
    async def readyz() -> JSONResponse:
        state.backends.refresh()
        ready = bool(state.backends.prefill.backends and state.backends.decode.backends)
        if not ready:
            return JSONResponse({"status": "no backends"}, status_code=503)
        await state.load_tokenizer()
        if state.tokenizer is None:
            return JSONResponse(
                {"status": "no tokenizer", "reason": state.tokenizer_problem}, status_code=503
            )
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", responses=METRICS_RESPONSES | error_responses(401, 403))
    async def metrics(request: Request) -> Response:
        if not presents_metrics_token(request.headers, state.metrics_token_sha256):
            state.require_operator(request)
        scraped = await read_backends(state, "/metrics", lambda r: r.text)
        backends = CollectorRegistry(auto_describe=False)
        backends.register(BackendCounters(scraped))
        text = generate_latest(state.metrics.registry) + generate_latest(backends)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def pools() -> RouterPoolSummary:
        reports = await read_backends(
            state, "/v1/kvpool", lambda r: KvPoolReport.model_validate_json(r.content)
        )
        return summarise_pools(reports, await state.served_context())

    async def tenant_pools() -> TenantPoolSummary:
        return tenant_view(await pools())

    @app.get(
        "/v1/kvpool",
        response_model=RouterPoolSummary | TenantPoolSummary,
        responses=error_responses(401, 429, 503),
    )
    async def kvpool(request: Request) -> Response:
        """The operator's view is read now; a tenant's is at most a second old (it is the
        same for every tenant) and counts in the tenant's requests in flight."""
        if state.is_operator(request):
            return _json(await pools())

        async def admitted(slot: Slot) -> Response:
            return _json(await state.tenant_pools.get(tenant_pools))

        return await in_flight(state, state.tenant(request), admitted)

    @app.get("/internal/v1/tenant-requests", responses=error_responses(400, 401, 403))
    async def tenant_requests(request: Request, since: float, until: float) -> TenantRequests:
        """Requests answered per tenant between two unix times, in whole minutes: whose
        requests a revision served in a standing canary's exposure window. Internal token
        only: it names every tenant."""
        state.require_operator(request)
        if not 0 <= since <= until < float("inf"):
            raise errors.invalid_request("need 0 <= since <= until (unix seconds)", "since")
        return state.activity.between(since, until)

    @app.get("/internal/v1/backends", responses=error_responses(401, 403))
    async def backends_in_force(request: Request) -> BackendsInForce:
        state.require_operator(request)
        state.backends.refresh()
        return state.backends.report()

    @app.put(
        "/internal/v1/backends",
        responses=error_responses(401, 403, 409, 422),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": PUSH_SCHEMA}},
            }
        },
    )
    async def push_backends(request: Request) -> BackendsInForce:
        """The operator's push: this set replaces the one in force at once, unless a newer
        one (by version) is in force. Only with the internal token."""
        state.require_pusher(request)
        body = await request.body()
        try:
            written = BackendsFile.model_validate_json(body)
            state.backends.refresh()  # a newer file already on disk wins over an older push
            state.backends.push(written)
        except ValidationError as exc:
            invalid = invalid_body(exc.errors(), body, request.headers.get("content-type", ""))
            raise errors.invalid_backends(invalid.message, invalid.param) from exc
        except StalePush as exc:
            raise errors.stale_backends(str(exc)) from exc
        except ValueError as exc:
            raise errors.invalid_backends(str(exc)) from exc
        log.info(
            "backends pushed: version %d, %d prefill, %d decode",
            written.version,
            len(written.prefill),
            len(written.decode),
        )
        return state.backends.report()

    @app.get("/v1/models", responses=error_responses(*OPENAI_ERRORS))
    async def models(request: Request) -> dict[str, Any]:
        state.tenant(request)
        await state.served_tokenizer()  # and the model's name with it
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvfence", "max_model_len": await state.served_context(),
        }]}  # fmt: skip

    # The key is checked on the headers before the body is read (serving/gate.py).
    tenants = APIRouter(route_class=checked_first(state.tenant))

    @tenants.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _complete(state, body, request)

    @tenants.post("/v1/chat/completions", responses=COMPLETION_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _complete(state, body, request)

    app.include_router(tenants)
    return app


def _json(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


async def _complete(
    state: RouterState, body: CompletionRequest | ChatCompletionRequest, request: Request
) -> Response:
    """Both completion routes: the tenant and the model first, then, within the tenant's
    requests in flight, the prompt's tokens and the relay through prefill and decode."""
    tenant = state.tenant(request)
    tokenizer = await state.served_tokenizer()
    check_model(body.model, state.model_name)

    async def admitted(slot: Slot) -> Response:
        context = await state.served_context()
        rejected = state.metrics.rejected
        prompt_ids = await tokenized_prompt(body, tokenizer, context, ANY_TOKEN_ID, rejected)
        return await relay(state, slot, prompt_ids, body, request)

    return await in_flight(state, tenant, admitted)
