"""Each tenant's share of the KV pool (--max-pool-share-per-tenant).

What is counted is a request's worst case, reserved when the engine takes it: the pages of its
prompt plus every token it may still generate (prompt + max_tokens - 1 slots). Pages are
allocated as decode proceeds, so counting live pages would let a tenant's admitted requests
grow past its share mid-stream, where the only remedies are preempting or failing a request
that is already answering. Reserving the worst case refuses at admission instead: a request
whose reservation would take its tenant over the share gets 429 before any page is allocated.

A reservation is taken when the engine takes custody of a request (it joins the scheduler, or
decode allocates its prompt) and given back when the scheduler releases a finished request's
pages: every way a request ends (finished, aborted, failed, expired) passes there, and a
preempted request, which is not finished, keeps its reservation. One object holds every
count, keyed by the request, so a count cannot drift: giving back twice is a no-op.
"""

import threading
from dataclasses import dataclass, field

from kvfence_engine.core import errors
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.pool_plan import tenant_share_pages


@dataclass(slots=True)
class TenantShares:
    num_pages: int
    share: float = 1.0  # fraction of the pool one tenant may reserve; 1.0: no cap
    _held: dict[int, tuple[str, int]] = field(default_factory=dict)  # seq_id -> (tenant, pages)
    _by_tenant: dict[str, int] = field(default_factory=dict)
    # admission checks from request threads; reservations from the engine thread
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"--max-pool-share-per-tenant must be in (0, 1], got {self.share}")

    @property
    def cap_pages(self) -> int:
        """Pages one tenant may reserve at once."""
        return tenant_share_pages(self.num_pages, self.share)

    @property
    def capped(self) -> bool:
        return self.share < 1.0

    def reserved(self, tenant: str) -> int:
        with self._lock:
            return self._by_tenant.get(tenant, 0)

    def by_tenant(self) -> dict[str, int]:
        """Pages reserved per tenant, for tenants that hold any (the gauge's label set is
        bounded by the requests in the engine, never by names ever seen)."""
        with self._lock:
            return dict(self._by_tenant)

    def refusal(self, tenant: str, pages: int) -> EngineError | None:
        """Why `pages` more for `tenant` would take it over its share now, or None."""
        with self._lock:
            return self._refusal(tenant, pages)

    def take(self, seq_id: int, tenant: str, pages: int) -> None:
        """Reserve `pages` for a request, or raise the 429 that refuses it."""
        with self._lock:
            assert seq_id not in self._held, f"seq {seq_id} already holds a reservation"
            error = self._refusal(tenant, pages)
            if error is not None:
                raise error
            self._held[seq_id] = (tenant, pages)
            self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + pages

    def give_back(self, seq_id: int) -> None:
        """The request is over: its reservation returns to its tenant's share (idempotent)."""
        with self._lock:
            held = self._held.pop(seq_id, None)
            if held is None:
                return
            tenant, pages = held
            left = self._by_tenant[tenant] - pages
            assert left >= 0, f"tenant {tenant!r} would reserve {left} pages"
            if left:
                self._by_tenant[tenant] = left
            else:
                del self._by_tenant[tenant]

    def _refusal(self, tenant: str, pages: int) -> EngineError | None:
        if not self.capped:
            return None
        held = self._by_tenant.get(tenant, 0)
        if held + pages <= self.cap_pages:
            return None
        return errors.tenant_pool_share(
            f"tenant {tenant!r} has reached its share of the KV pool "
            f"({self.share:g} of this engine's pool): this request needs {pages} more pages "
            "for its prompt and max_tokens; retry when its other requests finish, or lower "
            "max_tokens",
        )
