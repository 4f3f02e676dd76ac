"""What the router serves from: its tenants and who may see what (the auth policy), its
tokenizer, the served context, its metrics and its HTTP client to the backends.

Who may see what: a tenant (an API key of the keys files, or everyone as `default` without
them) sees its own answers; the operational view (every tenant's counts, backend addresses,
the backends in force) needs the internal token, and replacing the backends needs it always.
"""

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter
from starlette.datastructures import Headers

from kvfence_engine.auth import bearer_of, presents_internal_token
from kvfence_engine.contracts import DEFAULT_TENANT, TOKEN_HEADER, PoolSize, TenantPoolSummary
from kvfence_engine.core import errors
from kvfence_engine.loading.tokenizer import Tokenizer
from kvfence_engine.router.backends import Backends
from kvfence_engine.router.engine_tokenizer import fetch_tokenizer
from kvfence_engine.router.keys import ApiKeys
from kvfence_engine.router.placement import PrefixRouting
from kvfence_engine.router.recent import Recent
from kvfence_engine.router.request_counts import OPERATOR, UNAUTHENTICATED
from kvfence_engine.router.tenant_activity import TenantActivity
from kvfence_engine.router.tenants import InflightCollector, TenantInflight
from kvfence_engine.serving.connections import CLIENT_IDLE_SECONDS

log = logging.getLogger(__name__)
TENANT_VIEW_SECONDS = 1.0


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
            "answers of the API (/v1/...) by tenant and HTTP status (router/request_counts.py)",
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
            timeout=httpx.Timeout(300.0, connect=3.0),
            limits=httpx.Limits(max_connections=512, keepalive_expiry=CLIENT_IDLE_SECONDS),
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
    # a tenant's GET /v1/kvpool: read from the backends at most once a second (recent.py)
    tenant_pools: Recent[TenantPoolSummary] = field(
        default_factory=lambda: Recent(TENANT_VIEW_SECONDS)
    )
    # which tenants it answered, minute by minute (a standing canary's exposure window)
    activity: TenantActivity = field(default_factory=TenantActivity)

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
            raise errors.invalid_api_key()
        return tenant

    def tenant_label(self, headers: Headers) -> str:
        """Whom a request's count goes to (router/request_counts.py): its tenant, the
        operator for the internal token, else a fixed label, never the key it presented."""
        if self.api_keys is None:
            return DEFAULT_TENANT
        tenant = self.api_keys.tenant_of(bearer_of(headers))
        if tenant is not None:
            return tenant
        if self.internal_token and presents_internal_token(headers, self.internal_token):
            return OPERATOR
        return UNAUTHENTICATED

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
                if str(exc) != self.tokenizer_problem:  # once per new problem, with addresses
                    log.warning("no tokenizer from the engines %s: %s", urls, exc)
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
            raise errors.not_ready(f"the router has no tokenizer yet: {self.tokenizer_problem}")
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
            raise errors.forbidden(
                f"{request.url.path} is off: this router has API keys but no internal token "
                "(start it with --internal-token-file)"
            )
        if self.api_keys is not None and self.api_keys.tenant_of(bearer_of(request.headers)):
            raise errors.forbidden(
                f"{request.url.path} is for the operator and Prometheus, not tenants: "
                "it needs the internal token"
            )
        raise errors.internal_token_required(request.url.path)

    def require_pusher(self, request: Request) -> None:
        """Who may replace the backends: only a caller with the internal token (never a
        router without one, even on a laptop)."""
        if self.internal_token is None:
            raise errors.forbidden(
                f"{request.url.path} is off: this router has no internal token (start it with "
                "--internal-token-file)"
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
