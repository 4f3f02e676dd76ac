"""`kvfence_router_requests_total{tenant,status}`: every answer of the router's API (`/v1/...`)
counted by who asked and the HTTP status it got (issue 34, item 6), refusals included: a 400
for a bad body, a 401 for no key, a 413 the body cap answered before any handler ran, a 429,
a 500, a 503. Counted as the status line leaves, by an ASGI middleware outside every other,
so no route or refusal can forget it.

The label set stays bounded: statuses are HTTP's, and `tenant` is a tenant of the keys files
(or `default` without them), `(operator)` for the internal token, or `(unauthenticated)` for
anything else: a key nobody issued never becomes a label. The parentheses are outside a
tenant name's characters (router/keys.py), so no tenant can be counted as either.

Probes and the operational endpoints (`/healthz`, `/readyz`, `/metrics`, `/internal/...`) are
no tenant's requests and are not counted.
"""

from collections.abc import Callable

from prometheus_client import Counter
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence_engine.router.tenant_activity import TenantActivity

UNAUTHENTICATED = "(unauthenticated)"
OPERATOR = "(operator)"
COUNTED_PREFIX = "/v1/"


class RequestCounts:
    """ASGI middleware: one count of `requests` per answer of the API, labelled with
    `tenant_of(headers)` and the status."""

    def __init__(
        self,
        app: ASGIApp,
        tenant_of: Callable[[Headers], str],
        requests: Counter,
        activity: TenantActivity | None = None,
    ) -> None:
        self.app = app
        self.tenant_of = tenant_of
        self.requests = requests
        self.activity = activity  # which tenant it answered when (router/tenant_activity.py)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(COUNTED_PREFIX):
            await self.app(scope, receive, send)
            return

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                tenant = self.tenant_of(Headers(scope=scope))
                self.requests.labels(tenant=tenant, status=str(message["status"])).inc()
                if self.activity is not None and tenant not in (OPERATOR, UNAUTHENTICATED):
                    self.activity.record(tenant)
            await send(message)

        await self.app(scope, receive, counting)
