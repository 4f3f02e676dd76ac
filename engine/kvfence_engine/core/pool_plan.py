"""Pool arithmetic: a memory budget becomes pages; pages and a policy become the served context."""

from dataclasses import dataclass
from enum import StrEnum

from kvfence_engine.core.model_config import ModelConfig


class ContextPolicy(StrEnum):
    REFUSE = "refuse"  # serve the requested context; report a short pool, let the operator decide
    LOWER = "lower"  # serve what the pool holds, rounded down to a page


@dataclass(frozen=True, slots=True)
class PoolPlan:
    page_size: int
    num_pages: int
    kv_bytes_per_token: int
    budget_bytes: int

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size


# --prefix-cache-share, --prefix-cache-tenants, --prefix-cache-idle-seconds
PREFIX_CACHE_SHARE = 0.25
PREFIX_CACHE_TENANTS = 8
PREFIX_CACHE_IDLE_SECONDS = 600.0


@dataclass(frozen=True, slots=True)
class CachePartition:
    """The prefix cache's part of a pool (core/page_book): `pages` no request's allocation
    takes, in `tenants` slots of pages // tenants each; a page idle `idle_seconds` leaves."""

    pages: int = 0
    tenants: int = 1
    idle_seconds: float = float("inf")

    @property
    def quota(self) -> int:
        return self.pages // self.tenants


def cache_partition(
    num_pages: int, share: float, tenants: int, idle_seconds: float
) -> CachePartition:
    """--prefix-cache-share of a pool of `num_pages`, for --prefix-cache-tenants slots."""
    check_cache_flags(share, tenants, idle_seconds)
    pages = int(num_pages * share)
    if pages < tenants:
        raise ValueError(
            f"--prefix-cache-share {share} of {num_pages} pages is {pages} pages: less than "
            f"one page for each of --prefix-cache-tenants {tenants}; raise the share or the "
            "KV memory, or lower the tenants"
        )
    return CachePartition(pages, tenants, idle_seconds)


def check_cache_flags(share: float, tenants: int, idle_seconds: float) -> None:
    """What the prefix cache's flags must be, whatever the pool (ValueError: a usage error)."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"--prefix-cache-share must be in (0, 1), got {share}")
    if tenants < 1:
        raise ValueError(f"--prefix-cache-tenants must be at least 1, got {tenants}")
    if idle_seconds <= 0:
        raise ValueError(f"--prefix-cache-idle-seconds must be positive, got {idle_seconds}")


def plan_pool(
    config: ModelConfig, *, page_size: int, dtype_bytes: int, budget_bytes: int
) -> PoolPlan:
    per_token = config.kv_bytes_per_token(dtype_bytes)
    num_pages = budget_bytes // (per_token * page_size)
    if num_pages < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds no page: one page of {page_size} tokens "
            f"needs {per_token * page_size} bytes ({per_token} bytes/token); raise "
            "--kv-cache-memory"
        )
    return PoolPlan(page_size, num_pages, per_token, budget_bytes)


def effective_context(
    requested: int, pool_tokens: int, page_size: int, policy: ContextPolicy
) -> int:
    """What is served: `requested` under Refuse, and under LowerContext too when the pool holds
    it (a context that is not a whole number of pages is never lowered below what the pool
    holds); else the whole pages of the pool."""
    if policy is ContextPolicy.REFUSE or requested <= pool_tokens:
        return requested
    return pool_tokens // page_size * page_size


def admission_limit(effective: int, pool_tokens: int) -> int:
    """No request may hold more KV slots than the served context or the whole pool."""
    return min(effective, pool_tokens)


def tenant_share_pages(num_pages: int, share: float) -> int:
    """Pages one tenant may reserve at once under --max-pool-share-per-tenant: at least one (a
    share never shuts a tenant out completely). The operator's pool gate uses the same rule."""
    return max(1, int(num_pages * share))


def budget_raise_percent(pool_tokens: int, needed_tokens: int, page_size: int) -> int | None:
    """By how much (in percent, rounded up) the KV memory budget that gave a pool of
    `pool_tokens` must grow for the pool to hold `needed_tokens`: pages grow with the budget,
    and a need is met in whole pages. None for an empty pool (no percentage of nothing)."""
    if pool_tokens <= 0:
        return None
    needed = -(-needed_tokens // page_size) * page_size
    return max(1, -(-(needed - pool_tokens) * 100 // pool_tokens))
