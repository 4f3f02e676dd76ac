"""Pool probes off the reconcile pass: each engine pod's /v1/kvpool is read once per container
instance, in a bounded worker pool, and the pass reads what the probes found.

A pool cannot change while the engine process runs, so a report holds until the container
restarts (a new containerID or restartCount): it is never read again, and a slow or failed read
can never turn a judged pod's gate False. A failed read (the engine still loading, a pod
without an IP) is retried on later passes with back-off. The pass waits briefly for the probes
it starts (`wait_seconds`), so a pod that answers at once is judged in the same pass; one that
does not is `PoolUnknown` ("probing") until it does. `read_pool` is the one read.
"""

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field

import httpx

from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.tools import http_clients
from kvfence_operator.decisions.pool_gate import PodPool, parse_pool

PoolReader = Callable[[str, str, str, str | None, str | None], PodPool]
WORKERS = 8
WAIT_SECONDS = 0.5
FIRST_RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 10.0
FORGET_SECONDS = 600.0  # an instance no pass asked about for this long is dropped
PROBING = "probing"
PROBE_TIMEOUT_SECONDS = 3.0


def read_pool(
    pod: str, role: str, revision: str, url: str | None, internal_token: str | None = None
) -> PodPool:
    """GET <url>/v1/kvpool, with the revision's internal token (an engine that has one
    requires it there). Never raises: an unreachable pod is a PodPool with an error."""
    if url is None:
        return PodPool(pod, role, revision, error="no pod IP yet")
    headers = {TOKEN_HEADER: internal_token} if internal_token else {}
    try:
        response = http_clients.get(
            url + "/v1/kvpool", headers=headers, timeout=PROBE_TIMEOUT_SECONDS
        )
        response.raise_for_status()
        payload = response.json()
    except httpx.HTTPStatusError as exc:
        return PodPool(pod, role, revision, error=f"/v1/kvpool answered {exc.response.status_code}")
    except httpx.HTTPError as exc:
        return PodPool(pod, role, revision, error=f"unreachable at {url} ({type(exc).__name__})")
    except ValueError:
        return PodPool(pod, role, revision, error="/v1/kvpool answered non-JSON")
    return parse_pool(pod, role, revision, payload)


@dataclass(frozen=True, slots=True)
class Probe:
    """What to read: the pod, and the instance its report belongs to."""

    pod: str
    role: str
    revision: str
    url: str | None
    token: str | None
    instance: str


@dataclass(slots=True)
class _Entry:
    found: PodPool | None = None  # the last result: a report, or the last error
    running: Future[PodPool] | None = None
    failures: int = 0
    retry_at: float = 0.0
    seen: float = 0.0


@dataclass
class PoolProber:
    read: PoolReader = read_pool
    workers: int = WORKERS
    wait_seconds: float = WAIT_SECONDS
    first_retry_seconds: float = FIRST_RETRY_SECONDS
    max_retry_seconds: float = MAX_RETRY_SECONDS
    clock: Callable[[], float] = time.monotonic
    _entries: dict[Probe, _Entry] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _pool: ThreadPoolExecutor | None = field(default=None, init=False)

    def pools(self, probes: Sequence[Probe]) -> list[PodPool]:
        """The pool of each probe's pod, in order: its report once read, else the last error,
        else PoolUnknown "probing". Starts the reads that are due and waits at most
        `wait_seconds` for them."""
        now = self.clock()
        started: list[Future[PodPool]] = []
        with self._lock:
            for probe in probes:
                entry = self._entries.setdefault(probe, _Entry())
                entry.seen = now
                if _has_report(entry.found) or entry.running is not None or now < entry.retry_at:
                    continue
                entry.running = self._executor().submit(self._read, probe)
                started.append(entry.running)
            self._forget(now)
        if started and self.wait_seconds > 0:
            wait_for(started, timeout=self.wait_seconds)
        with self._lock:
            return [self._result(probe) for probe in probes]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvpool-probe")
        return self._pool

    def _read(self, probe: Probe) -> PodPool:
        try:
            return self.read(probe.pod, probe.role, probe.revision, probe.url, probe.token)
        except Exception as exc:  # read_pool never raises; a reader that does is a failed read
            return PodPool(probe.pod, probe.role, probe.revision, error=f"probe failed: {exc}")

    def _result(self, probe: Probe) -> PodPool:
        entry = self._entries[probe]
        if entry.running is not None and entry.running.done():
            found = entry.running.result()
            entry.running = None
            if _has_report(found) or not _has_report(entry.found):
                entry.found = found
            if _has_report(found):
                entry.failures = 0
            else:
                delay = self.first_retry_seconds * 2**entry.failures
                entry.failures += 1
                entry.retry_at = self.clock() + min(delay, self.max_retry_seconds)
        if entry.found is not None:
            return entry.found
        return PodPool(probe.pod, probe.role, probe.revision, error=PROBING)

    def _forget(self, now: float) -> None:
        for key, entry in list(self._entries.items()):
            if entry.running is None and now - entry.seen > FORGET_SECONDS:
                del self._entries[key]


def _has_report(pool: PodPool | None) -> bool:
    return pool is not None and pool.report is not None
