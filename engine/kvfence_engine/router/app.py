"""The router: the OpenAI front of a disaggregated deployment.

Per request: authenticate the tenant, tokenize and refuse over-limit prompts (defence in depth;
decode and prefill check again), reserve pages on a decode instance (a refusal there ends the
request before prefill is touched), have a prefill instance compute the prompt's KV and stream
it to that decode instance, then relay decode's tokens. A client that leaves before the first
token exists does not cancel the work mid-transfer: both halves are cancelled once it exists.

The engines sit behind a NetworkPolicy, so the router also shows what a canary must check:
GET /v1/kvpool summarises the backends' pools and /metrics re-exports their isolation counters.

What a tenant sees (issue 12, finding 4): its own answers, the served context, each engine's
role and pool size. Not other tenants' names or counts (/metrics needs the internal token or
Prometheus's metrics token), not where the engines are (the tenant's /v1/kvpool names no URL
or port, and a backend's server-side error reaches the client as a generic message; the detail
goes to the log under the request id), not how full the pools are.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from pydantic import BaseModel, ValidationError

from kvfence_engine.auth import bearer_of, presents_internal_token, presents_metrics_token
from kvfence_engine.contracts import (
    DEFAULT_TENANT,
    TOKEN_HEADER,
    AbortBody,
    BackendPool,
    BackendReport,
    BackendsFile,
    BackendsInForce,
    BackendUnread,
    DecodeBody,
    DeltaLine,
    FirstToken,
    KvPoolReport,
    PoolSize,
    PrefillBody,
    PrefillReply,
    ReserveBody,
    ReserveReply,
    Role,
    RouterPoolSummary,
    Sampling,
    TenantPoolSummary,
    TransferHandle,
)
from kvfence_engine.core import errors
from kvfence_engine.core.deltas import Delta
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.metrics import BACKEND_PREFIX, ISOLATION_COUNTERS, PREFIX_CACHE_COUNTERS
from kvfence_engine.disagg.wire import delta_of
from kvfence_engine.loading.detokenizer import Detokenizer
from kvfence_engine.loading.tokenizer import Tokenizer
from kvfence_engine.router.backends import Backend, Backends, StalePush
from kvfence_engine.router.engine_tokenizer import fetch_tokenizer
from kvfence_engine.router.keys import ApiKeys, request_id_for
from kvfence_engine.router.placement import PrefixRouting
from kvfence_engine.router.tenants import InflightCollector, Slot, TenantInflight
from kvfence_engine.serving.limits import refuse_unfittable_prompt
from kvfence_engine.serving.openai_api import (
    COMPLETION_RESPONSES,
    METRICS_RESPONSES,
    OPENAI_ERRORS,
    READYZ_RESPONSES,
    OpenAIOutput,
    chat_logprobs,
    chat_prompt,
    check_model,
    completion_prompt,
    error_responses,
    invalid_body,
    naming_prompt_field,
    new_app,
    prompt_field,
    respond,
)
from kvfence_engine.serving.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)
# PUT's body, read by hand so that the token is checked before the body and a bad body is a
# 422 (FastAPI would check the body first, as a 400); the response model puts it in components.
PUSH_SCHEMA = {"$ref": "#/components/schemas/BackendsFile"}
BACKEND_READ_TIMEOUT = 2.0  # a slow engine must not stall the router's /metrics or /v1/kvpool


@dataclass(slots=True)
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    requests: Counter = field(init=False)
    rejected: Counter = field(init=False)
    backend_errors: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "kvfence_router_requests",
            "requests by tenant and HTTP status",
            ["tenant", "status"],
            registry=r,
        )
        self.rejected = Counter(
            "kvfence_requests_rejected", "requests refused by the router", ["reason"], registry=r
        )
        self.backend_errors = Counter(
            "kvfence_router_backend_errors",
            "calls to an instance that failed to connect or broke",
            ["role"],
            registry=r,
        )


@dataclass(slots=True)
class RouterState:
    model_name: str
    tokenizer: Tokenizer | None  # None: read from an engine (tokenizer_source) when it can be
    backends: Backends
    api_keys: ApiKeys | None  # None: no keys files, every request is the default tenant
    internal_token: str | None
    context_length: int | None = None  # explicit --context-length wins over everything
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    client: httpx.AsyncClient = field(
        default_factory=lambda: httpx.AsyncClient(
            timeout=httpx.Timeout(300.0, connect=3.0), limits=httpx.Limits(max_connections=512)
        )
    )
    inflight: TenantInflight = field(default_factory=TenantInflight)
    _discovered_context: int | None = None
    background: set["asyncio.Task[None]"] = field(default_factory=set)
    # --tokenizer-from-engines: read it from an engine, which must serve tokenizer_source if set
    tokenizer_from_engines: bool = False
    tokenizer_source: str | None = None
    tokenizer_problem: str = "not read yet"
    metrics_token_sha256: bytes | None = None  # Prometheus's token: opens /metrics only
    _tokenizer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # --routing-secret-file: prefill by prefix within a tenant (the prefix cache's hits)
    routing: PrefixRouting | None = None

    def __post_init__(self) -> None:
        self.metrics.registry.register(InflightCollector(self.inflight))

    def in_background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def tenant(self, request: Request) -> str:
        if self.api_keys is None:
            return DEFAULT_TENANT
        tenant = self.api_keys.tenant_of(bearer_of(request.headers))
        if tenant is None:
            raise EngineError(
                401, "missing or invalid API key", "invalid_request_error", "invalid_api_key"
            )
        return tenant

    async def load_tokenizer(self) -> None:
        """With tokenizer_from_engines: read the tokenizer from an engine of the backends,
        once; a failure is kept in tokenizer_problem and tried again at the next call."""
        if self.tokenizer is not None or not self.tokenizer_from_engines:
            return
        async with self._tokenizer_lock:
            if self.tokenizer is not None:
                return
            self.backends.refresh()
            pools = (self.backends.prefill, self.backends.decode)
            urls = [b.url for pool in pools for b in pool.backends]
            try:
                got = await fetch_tokenizer(
                    self.client, urls, self.headers(), self.tokenizer_source
                )
            except ValueError as exc:
                self.tokenizer_problem = str(exc)
                return
            self.model_name = self.model_name or got.name or "model"
            self.tokenizer = got.tokenizer

    async def served_tokenizer(self) -> Tokenizer:
        """The tokenizer, or a 503 that says why there is none yet."""
        await self.load_tokenizer()
        return self.require_tokenizer()

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise EngineError(
                503,
                f"the router has no tokenizer yet: {self.tokenizer_problem}",
                "server_error",
                "not_ready",
                None,
                2,
            )
        return self.tokenizer

    def headers(self) -> dict[str, str]:
        return {TOKEN_HEADER: self.internal_token} if self.internal_token else {}

    def is_operator(self, request: Request) -> bool:
        """Whether the caller may see the operational view (every tenant's counts, backend
        addresses): it presents the internal token. A router without one shows that view
        only when it has no tenants either (no keys: one user, on a laptop); with keys and no
        token, nobody sees it."""
        if self.internal_token is None:
            return self.api_keys is None
        return presents_internal_token(request.headers, self.internal_token)

    def require_operator(self, request: Request) -> None:
        if self.is_operator(request):
            return
        if self.internal_token is None:
            raise EngineError(
                403,
                f"{request.url.path} is off: this router has API keys but no internal token "
                "(start it with --internal-token-file)",
                "permission_error",
                "forbidden",
            )
        if self.api_keys is not None and self.api_keys.tenant_of(bearer_of(request.headers)):
            raise EngineError(
                403,
                f"{request.url.path} is for the operator and Prometheus, not tenants: "
                "it needs the internal token",
                "permission_error",
                "forbidden",
            )
        raise errors.internal_token_required(request.url.path)

    def require_pusher(self, request: Request) -> None:
        """Who may replace the backends: only a caller with the internal token (never a
        router without one, even on a laptop)."""
        if self.internal_token is None:
            raise EngineError(
                403,
                f"{request.url.path} is off: this router has no internal token (start it with "
                "--internal-token-file)",
                "permission_error",
                "forbidden",
            )
        self.require_operator(request)

    async def served_context(self) -> int:
        """--context-length, else what the operator wrote, else the smallest decode pool's
        effective context (read from the instances themselves)."""
        self.backends.refresh()
        if self.context_length is not None:
            return self.context_length
        if self.backends.context_length is not None:
            return int(self.backends.context_length)
        if self._discovered_context is None:
            values = []
            for backend in self.backends.decode.backends:
                try:
                    r = await self.client.get(
                        backend.url + "/v1/kvpool", headers=self.headers(), timeout=5.0
                    )
                    r.raise_for_status()
                    values.append(PoolSize.model_validate_json(r.content).context_length_effective)
                except (httpx.HTTPError, ValueError):  # ValidationError is a ValueError
                    continue
            if not values:
                raise errors.overloaded("no decode instance reported its context length", 2)
            self._discovered_context = min(values)
        return self._discovered_context


def create_router_app(state: RouterState) -> FastAPI:
    app = new_app("kvfence router")

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
        scraped = await _read_backends(state, "/metrics", lambda r: r.text)
        backends = CollectorRegistry(auto_describe=False)
        backends.register(BackendCounters(scraped))
        text = generate_latest(state.metrics.registry) + generate_latest(backends)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/kvpool", responses=error_responses(401, 503))
    async def kvpool(request: Request) -> RouterPoolSummary | TenantPoolSummary:
        operator = state.is_operator(request)
        if not operator:
            state.tenant(request)
        reports = await _read_backends(
            state, "/v1/kvpool", lambda r: KvPoolReport.model_validate_json(r.content)
        )
        summary = summarise_pools(reports, await state.served_context())
        return summary if operator else tenant_view(summary)

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
            raise dataclasses.replace(invalid, status=422, code="invalid_backends") from exc
        except StalePush as exc:
            raise EngineError(409, str(exc), "invalid_request_error", "stale_backends") from exc
        except ValueError as exc:
            raise EngineError(422, str(exc), "invalid_request_error", "invalid_backends") from exc
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

    @app.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tenant = state.tenant(request)
        tokenizer = await state.served_tokenizer()
        check_model(body.model, state.model_name)

        async def admitted(slot: Slot) -> Response:
            context = await state.served_context()
            refuse_unfittable_prompt(body, tokenizer, context, state.metrics.rejected)
            prompt_ids = await asyncio.to_thread(completion_prompt, body.prompt, tokenizer, 1 << 31)
            return await _route(
                state, slot, prompt_ids, body, body.max_tokens, body.logprobs, False, request
            )

        return await _in_flight(state, tenant, admitted)

    @app.post("/v1/chat/completions", responses=COMPLETION_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        tenant = state.tenant(request)
        tokenizer = await state.served_tokenizer()
        check_model(body.model, state.model_name)

        async def admitted(slot: Slot) -> Response:
            context = await state.served_context()
            refuse_unfittable_prompt(body, tokenizer, context, state.metrics.rejected)
            prompt_ids = await asyncio.to_thread(chat_prompt, tokenizer, body)
            max_tokens, logprobs = body.token_limit(), chat_logprobs(body)
            return await _route(state, slot, prompt_ids, body, max_tokens, logprobs, True, request)

        return await _in_flight(state, tenant, admitted)

    return app


BackendRead = tuple[Role, str, Any]  # (role, url, what was read or None)


async def _read_backends(
    state: RouterState, path: str, parse: Callable[[httpx.Response], Any]
) -> list[BackendRead]:
    """GET path from every backend at once; a backend that fails or is slow reads as None."""
    state.backends.refresh()
    targets = [
        (pool.role, backend.url)
        for pool in (state.backends.prefill, state.backends.decode)
        for backend in pool.backends
    ]

    async def read(url: str) -> Any:
        try:
            r = await state.client.get(
                url + path, headers=state.headers(), timeout=BACKEND_READ_TIMEOUT
            )
            return parse(r) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):  # ValidationError is a ValueError
            return None

    results = await asyncio.gather(*(read(url) for _, url in targets))
    return [(role, url, result) for (role, url), result in zip(targets, results, strict=True)]


def summarise_pools(reports: list[BackendRead], served_context: int) -> RouterPoolSummary:
    """The router's /v1/kvpool: each backend's own report, and the numbers that bound every
    request whichever instances it lands on (the smallest pool, the smallest context)."""
    read: list[KvPoolReport] = [report for _, _, report in reports if report is not None]
    if not read:
        raise errors.overloaded("no backend instance reported its KV pool", 2)
    return RouterPoolSummary(
        context_length_served=served_context,
        context_length_effective=min(r.context_length_effective for r in read),
        pool_tokens=min(r.pool_tokens for r in read),
        page_size=min(r.page_size for r in read),
        tag_check=all(r.tag_check for r in read),
        kv_checksum=all(r.kv_checksum for r in read),
        deferred_release=all(r.deferred_release for r in read),
        backends=[
            BackendReport(role=role, url=url, report=report)
            if report is not None
            else BackendUnread(role=role, url=url, error="unreachable or not ready")
            for role, url, report in reports
        ],
    )


def tenant_view(summary: RouterPoolSummary) -> TenantPoolSummary:
    """The summary without where the engines are (URL, transfer port) or how full they are
    (free pages): each engine's role and the numbers that bound a request."""
    return TenantPoolSummary(
        **summary.model_dump(exclude={"role", "backends"}),
        backends=[
            BackendPool(role=b.role, report=PoolSize.model_validate(b.report.model_dump()))
            if isinstance(b, BackendReport)
            else BackendPool(role=b.role, error=b.error)
            for b in summary.backends
        ],
    )


class BackendCounters(Collector):
    """Each engine's isolation and prefix-cache counters as scraped just now, labelled by role
    and backend, and whether its /metrics could be read at all (a canary must not mistake
    "unreadable" for 0)."""

    def __init__(self, scraped: list[BackendRead]) -> None:
        self.scraped = scraped

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "backend"]
        up = GaugeMetricFamily(
            BACKEND_PREFIX + "up", "1 if the router just read this engine's /metrics", labels=labels
        )
        counters = {
            name: CounterMetricFamily(
                BACKEND_PREFIX + name.removeprefix("kvfence_"),
                f"{name}_total of each engine, read by the router",
                labels=labels,
            )
            for name in (*ISOLATION_COUNTERS, *PREFIX_CACHE_COUNTERS)
        }
        for role, url, text in self.scraped:
            families = _parse_metrics(text)
            up.add_metric([role, url], 0.0 if families is None else 1.0)
            for family in families or ():
                for sample in family.samples if family.name in counters else ():
                    if sample.name == family.name + "_total":
                        counters[family.name].add_metric([role, url], sample.value)
        yield up
        yield from counters.values()


def _parse_metrics(text: str | None) -> list[Metric] | None:
    if text is None:
        return None
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:
        return None


async def _in_flight(
    state: RouterState, tenant: str, admitted: Callable[[Slot], Awaitable[Response]]
) -> Response:
    """Run a request within its tenant's --max-concurrent-per-tenant: counted in now, out
    when its answer is over (a stream: when it ends, breaks or its client leaves)."""
    try:
        slot = state.inflight.enter(tenant)
    except EngineError as exc:
        state.metrics.rejected.labels(reason=exc.code).inc()
        state.metrics.requests.labels(tenant=tenant, status=str(exc.status)).inc()
        raise
    try:
        response = await admitted(slot)
    except BaseException:
        slot.release()
        raise
    if not isinstance(response, StreamingResponse):
        slot.release()  # whole: the answer is over (a stream's deltas release it at their end)
    return response


async def _route(
    state: RouterState,
    slot: Slot,
    prompt_ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    chat: bool,
    request: Request,
) -> Response:
    tenant = slot.tenant
    limit = await state.served_context()
    if not prompt_ids:  # what the engine's admission says, not ReserveBody's field name
        raise errors.invalid_request("the prompt is empty", "prompt")
    if len(prompt_ids) > limit:
        state.metrics.rejected.labels(reason="context_length_exceeded").inc()
        raise errors.context_length_exceeded(
            len(prompt_ids), limit, "the served context", prompt_field(body)
        )
    sampling = Sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        logprobs=logprobs,
        ignore_eos=body.ignore_eos,
    )
    request_id = request_id_for(tenant)
    try:
        reserve = ReserveBody(
            request_id=request_id,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
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
    out = OpenAIOutput(chat, state.model_name, state.require_tokenizer(), len(prompt_ids))
    out.cached_tokens = prefilled.cached_tokens  # this tenant's own hit, decided by prefill
    try:
        first_delta = await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise
    state.metrics.requests.labels(
        tenant=tenant, status="200" if first_delta.error is None else str(first_delta.error.status)
    ).inc()
    detok = Detokenizer(state.require_tokenizer(), body.stops())
    return await respond(first_delta, deltas, out, detok, body, request.is_disconnected)


ReplyT = TypeVar("ReplyT", bound=BaseModel)


class Unreachable(EngineError):
    """An instance did not answer at all (refused, reset, timed out), or answered as no
    instance of this deployment would: a clean 503."""


ErrorT = TypeVar("ErrorT", bound=EngineError)


# What a client reads instead of a backend's server-side error message, by error code. The
# engines' messages are for the router and the log: they may name an instance's address ("KV
# transfer to decode failed: ... 10.0.3.7:9000") or the pool's occupancy ("no free KV pages
# for 300 tokens: ... 3 free").
CLIENT_MESSAGES = {
    "overloaded": "the service is at capacity; retry shortly",
    "not_ready": "the service is starting; retry shortly",
    "backend_unreachable": "no instance of the service answered; retry shortly",
    "kv_isolation_violation": "The request was stopped before generating from KV cache it does "
    "not own. No output was produced from that data.",
}


def client_facing(error: ErrorT, request_id: str) -> ErrorT:
    """A backend's error as the client may see it: a 4xx is about the request and passes on
    whole; a 5xx keeps its status, type, code and Retry-After, gets a generic message, and its
    detail is logged under the request id (which the client's message names)."""
    if error.status < 500 or error.code == "internal_error":  # that one names a reference only
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
        error = _error_from(r)
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
NOT_AN_INSTANCE_OF_OURS = frozenset({"unauthorized", "wrong_role"})


def _out_of_rotation(
    state: RouterState, backend: Backend, role: Role, why: str, request_id: str
) -> Unreachable:
    """Take `backend` out of rotation; the client's 503 (names no address)."""
    state.metrics.backend_errors.labels(role=role).inc()
    pool = state.backends.prefill if role is Role.PREFILL else state.backends.decode
    pool.mark_down(backend)
    unreachable = Unreachable(
        503, f"{role} instance {backend.url} {why}", "server_error", "backend_unreachable", None, 1
    )
    return client_facing(unreachable, request_id)


def _error_from(r: httpx.Response) -> EngineError:
    try:
        e = r.json()["error"]
        return EngineError(
            r.status_code,
            e["message"],
            e["type"],
            e["code"],
            e.get("param"),
            int(r.headers["retry-after"]) if "retry-after" in r.headers else None,
        )
    except (ValueError, KeyError, TypeError):
        return EngineError(502, f"backend answered {r.status_code}", "server_error", "bad_gateway")


async def _reserve(state: RouterState, body: ReserveBody) -> tuple[Backend, TransferHandle]:
    tried: set[str] = set()
    while True:
        decode = state.backends.decode.pick(tried)
        tried.add(decode.url)
        try:
            reply = await _call(
                state, decode, Role.DECODE, "/internal/reserve", body, ReserveReply, body.request_id
            )
        except Unreachable:
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
                yield Delta([], [], "error", client_facing(_error_from(r), request_id))
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
