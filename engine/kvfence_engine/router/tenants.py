"""Each tenant's requests in flight at the router (--max-concurrent-per-tenant).

A request counts from admission (authenticated, before its prompt is tokenized) until its
answer is over: a whole response when it is returned, a stream when it ends, breaks or its
client leaves. Over the limit a request gets 429 tenant_limit with Retry-After, so one tenant
cannot fill the router's queue and the backends' batches with its own requests.

The router runs on one event loop, so the counts need no lock. Tenants come from the keys
file, so the metric's label set is bounded by it.
"""

import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence_engine.core import errors

T = TypeVar("T")


@dataclass(slots=True)
class TenantInflight:
    limit: int = 0  # most requests in flight per tenant; 0: no limit
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"--max-concurrent-per-tenant must be >= 0, got {self.limit}")

    def enter(self, tenant: str) -> "Slot":
        """Count a request in, or raise the 429 that refuses it."""
        held = self.counts.get(tenant, 0)
        if self.limit and held >= self.limit:
            raise errors.tenant_limit(
                f"tenant {tenant!r} already has {held} requests in flight, its limit; retry "
                "when one of them has finished"
            )
        self.counts[tenant] = held + 1
        return Slot(self, tenant)


class Slot:
    """One request's place in its tenant's count; released exactly once."""

    __slots__ = ("__weakref__", "_owner", "_released", "tenant")

    def __init__(self, owner: TenantInflight, tenant: str) -> None:
        self._owner = owner
        self.tenant = tenant
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner.counts[self.tenant] -= 1

    def held_until_closed(self, items: AsyncIterator[T]) -> AsyncGenerator[T]:
        """`items`, holding this slot until they end or are closed. A stream that is never
        started (its response was dropped before the first byte) releases it when collected."""
        wrapped = _held(self, items)
        weakref.finalize(wrapped, self.release)
        return wrapped


async def _held(slot: Slot, items: AsyncIterator[T]) -> AsyncGenerator[T]:
    try:
        async for item in items:
            yield item
    finally:
        try:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            slot.release()


class InflightCollector(Collector):
    """kvfence_router_tenant_inflight{tenant}, read at scrape time."""

    def __init__(self, inflight: TenantInflight) -> None:
        self.inflight = inflight

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvfence_router_tenant_inflight",
            "requests of each tenant in flight at the router (what "
            "--max-concurrent-per-tenant caps)",
            labels=["tenant"],
        )
        for tenant, count in sorted(self.inflight.counts.items()):
            family.add_metric([tenant], count)
        yield family
