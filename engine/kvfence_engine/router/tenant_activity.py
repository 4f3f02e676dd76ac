"""Which tenants a router answered, and how often, minute by minute over the last day: what
the operator asks a serving revision's routers when a standing canary run fails, to name the
tenants whose requests were served in the exposure window (GET /internal/v1/tenant-requests,
internal token only; contracts.TenantRequests).

Kept in memory, in whole minutes (a window is widened to them: it can only count more), for
RETENTION_SECONDS; a router that restarted knows only what it answered since, which the answer
says (`covered_since`). Only tenants of the keys files are counted: not the operator's
internal-token requests, nor unauthenticated ones (router/request_counts.py)."""

import time
from collections import Counter
from collections.abc import Callable

from kvfence_engine.contracts import TenantRequests

RETENTION_SECONDS = 24 * 3600
MINUTE = 60


class TenantActivity:
    def __init__(
        self, clock: Callable[[], float] = time.time, retention: float = RETENTION_SECONDS
    ) -> None:
        self._clock = clock
        self._retention = retention
        self.started = clock()
        self._minutes: dict[int, Counter[str]] = {}

    def record(self, tenant: str) -> None:
        minute = int(self._clock() // MINUTE)
        counts = self._minutes.get(minute)
        if counts is None:
            counts = self._minutes[minute] = Counter()
            oldest = int((self._clock() - self._retention) // MINUTE)
            for old in [m for m in self._minutes if m < oldest]:
                del self._minutes[old]
        counts[tenant] += 1

    def between(self, since: float, until: float) -> TenantRequests:
        """Requests answered per tenant in the minutes from `since`'s to `until`'s."""
        first, last = int(since // MINUTE), int(until // MINUTE)
        total: Counter[str] = Counter()
        for minute, counts in self._minutes.items():
            if first <= minute <= last:
                total.update(counts)
        covered = max(self.started, self._clock() - self._retention)
        return TenantRequests(
            since=first * MINUTE,
            until=(last + 1) * MINUTE,
            covered_since=covered,
            tenants=dict(sorted(total.items())),
        )
