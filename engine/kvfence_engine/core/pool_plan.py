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
    if policy is ContextPolicy.REFUSE:
        return requested
    return min(requested, pool_tokens) // page_size * page_size


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
