"""Prometheus metrics of one engine process (own registry, so tests can run several)."""

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)

# Counters that move only when a KV isolation defence acted. In Kubernetes only the router is
# reachable from outside the engines' NetworkPolicy, so it re-exports them per backend under
# BACKEND_PREFIX (kvfence_kv_tag_mismatch_total -> kvfence_backend_kv_tag_mismatch_total).
ISOLATION_COUNTERS = (
    "kvfence_kv_tag_mismatch",
    "kvfence_kv_unwritten_read",
    "kvfence_transfer_checksum_failed",
    "kvfence_transfer_count_mismatch",
    "kvfence_late_writes_dropped",
    "kvfence_kv_foreign_tenant_read",
)
# The prefix cache's hit rate (hit / queried tokens), which the router also re-exports per
# backend: its role label gives the rate per role (combined or prefill; decode has no cache).
PREFIX_CACHE_COUNTERS = (
    "kvfence_prefix_cache_hit_tokens",
    "kvfence_prefix_cache_queried_tokens",
)
BACKEND_PREFIX = "kvfence_backend_"


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.pool_tokens = Gauge(
            "kvfence_kv_pool_tokens", "KV slots allocated (pages x page size)", registry=r
        )
        self.pages_total = Gauge("kvfence_kv_pages_total", "KV pages in the pool", registry=r)
        self.pages_used = Gauge("kvfence_kv_pages_used", "KV pages held by requests", registry=r)
        self.context_length = Gauge(
            "kvfence_context_length_tokens", "served (effective) context length", registry=r
        )
        self.tag_mismatch = Counter(
            "kvfence_kv_tag_mismatch", "reads refused: a held page carried another tag", registry=r
        )
        self.unwritten_read = Counter(
            "kvfence_kv_unwritten_read",
            "reads refused: slots never written for the reader",
            registry=r,
        )
        self.foreign_tenant_read = Counter(
            "kvfence_kv_foreign_tenant_read",
            "reads refused: a shared prefix-cache page belonged to another tenant",
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "kvfence_prefix_cache_hit_tokens",
            "prompt tokens read from the prefix cache instead of computed",
            registry=r,
        )
        self.prefix_queried_tokens = Counter(
            "kvfence_prefix_cache_queried_tokens",
            "prompt tokens of requests that looked up the prefix cache",
            registry=r,
        )
        self.checksum_verified = Counter(
            "kvfence_transfer_checksum_verified",
            "transferred KV pages whose checksum matched",
            registry=r,
        )
        self.checksum_failed = Counter(
            "kvfence_transfer_checksum_failed",
            "transferred KV pages whose checksum differed",
            registry=r,
        )
        self.count_mismatch = Counter(
            "kvfence_transfer_count_mismatch",
            "transfers that wrote fewer tokens than reserved",
            registry=r,
        )
        self.late_writes_dropped = Counter(
            "kvfence_late_writes_dropped", "writes carrying a stale page tag, dropped", registry=r
        )
        self.stale_releases = Counter(
            "kvfence_kv_stale_releases",
            "releases of pages the releaser no longer held, ignored",
            registry=r,
        )
        self.rejected = Counter(
            "kvfence_requests_rejected",
            "requests refused before any page was allocated",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvfence_time_to_first_token_seconds",
            "arrival to first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prefill_batch = Histogram(
            "kvfence_prefill_batch_requests",
            "requests prefilled together in one step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.prompt_tokens = Counter("kvfence_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter(
            "kvfence_generation_tokens", "tokens generated", registry=r
        )
        self.preemptions = Counter(
            "kvfence_preemptions", "sequences preempted to free pages", registry=r
        )
        # What the read check costs, measured where it runs: its share of the step time.
        self.step_seconds = Counter(
            "kvfence_engine_step_seconds",
            "time in engine steps: scheduling, read check, forward pass, sampling",
            registry=r,
        )
        self.decode_steps = Counter(
            "kvfence_engine_decode_steps", "engine steps that decoded a batch", registry=r
        )
        self.step_failures = Counter(
            "kvfence_engine_step_failures",
            "steps that raised: each failed its own batch with internal_error",
            registry=r,
        )
        self.read_check_seconds = Counter(
            "kvfence_kv_read_check_seconds",
            "time in the per-step KV read check on the host (tags and fill counts of every held "
            "page); on a GPU, decode checks on the device, inside its step",
            registry=r,
        )
        self.running = Gauge("kvfence_requests_running", "sequences decoding", registry=r)
        self.waiting = Gauge("kvfence_requests_waiting", "sequences waiting", registry=r)
        self.queued_prompt_tokens = Gauge(
            "kvfence_queued_prompt_tokens",
            "prompt tokens still to compute, of waiting requests and of those being prefilled",
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "kvfence_inter_token_latency_seconds",
            "time between a sequence's consecutive tokens",
            buckets=_ITL_BUCKETS,
            registry=r,
        )

    def watch_tenants(self, reserved: Callable[[], dict[str, int]]) -> None:
        """Export each tenant's reserved KV pages (core/tenants) as read at scrape time."""
        self.registry.register(_TenantPages(reserved))


class _TenantPages(Collector):
    """kvfence_tenant_kv_pages_reserved{tenant}: only tenants with requests in the engine, so
    the label set is bounded by the pool, not by every name a request ever carried."""

    def __init__(self, reserved: Callable[[], dict[str, int]]) -> None:
        self.reserved = reserved

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvfence_tenant_kv_pages_reserved",
            "KV pages reserved by each tenant's requests in this engine (their prompts and "
            "max_tokens): what --max-pool-share-per-tenant caps",
            labels=["tenant"],
        )
        for tenant, pages in sorted(self.reserved().items()):
            family.add_metric([tenant], pages)
        yield family
