"""What the router shows of its backends: GET /v1/kvpool's summary of their pools (whole for
the operator, without addresses or occupancy for a tenant) and, on /metrics, their isolation
and prefix-cache counters as scraped just now. A canary reads both: the engines sit behind a
NetworkPolicy."""

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvfence_engine.contracts import (
    BackendPool,
    BackendReport,
    BackendUnread,
    KvPoolReport,
    PoolSize,
    Role,
    RouterPoolSummary,
    TenantPoolSummary,
)
from kvfence_engine.core import errors
from kvfence_engine.core.metrics import BACKEND_PREFIX, ISOLATION_COUNTERS, PREFIX_CACHE_COUNTERS
from kvfence_engine.router.state import RouterState

log = logging.getLogger(__name__)
BACKEND_READ_TIMEOUT = 2.0  # a slow engine must not stall the router's /metrics or /v1/kvpool


BackendRead = tuple[Role, str, Any]  # (role, url, what was read or None)


async def read_backends(
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
            if r.status_code == 200:
                return parse(r)
            why = f"HTTP {r.status_code}"
        except (httpx.HTTPError, ValueError) as exc:  # ValidationError is a ValueError
            why = repr(exc)
        log.info("GET %s from %s failed: %s", path, url, why)
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
