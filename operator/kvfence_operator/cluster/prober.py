"""Reads of each engine pod off the reconcile pass, in a bounded worker pool: the pass reads
what the probes found.

Two readings use it:

- the pool (`read_pool`, /v1/kvpool), read once per container instance: a pool cannot change
  while the engine process runs, so a report holds until the container restarts (a new
  containerID or restartCount). It is never read again, and a slow or failed read can never
  turn a judged pod's gate False;
- the load (`read_load`, /v1/load), read again every `refresh_seconds`: the autoscaler's
  signals. A pass never waits for it (`wait_seconds=0`): it decides on the latest reading,
  which says when it was read.

A failed read (the engine still loading, a pod without an IP) is retried on later passes with
back-off, and a report already read is kept over a failed read. The pass waits briefly for
the probes it starts (`wait_seconds`), so a pod that answers at once is judged in the same
pass; one that does not is "probing" until it does.
"""

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import httpx
from pydantic import ValidationError

from kvfence_engine.contracts import TOKEN_HEADER, TenantRequests
from kvfence_engine.tools import http_clients
from kvfence_operator.decisions.autoscaling import PodLoad, parse_load
from kvfence_operator.decisions.pool_gate import PodPool, parse_pool

PoolReader = Callable[[str, str, str, str | None, str | None], PodPool]
LoadReader = Callable[[str, str, str, str | None, str | None], PodLoad]
WORKERS = 8
WAIT_SECONDS = 0.5
FIRST_RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 10.0
FORGET_SECONDS = 600.0  # an instance no pass asked about for this long is dropped
PROBING = "probing"
PROBE_TIMEOUT_SECONDS = 3.0
LOAD_REFRESH_SECONDS = 1.0


def _get_json(url: str, path: str, internal_token: str | None) -> tuple[Any, str | None]:
    """GET <url><path> with the revision's internal token: (the JSON, None), or (None, why
    not). Never raises."""
    headers = {TOKEN_HEADER: internal_token} if internal_token else {}
    try:
        response = http_clients.get(url + path, headers=headers, timeout=PROBE_TIMEOUT_SECONDS)
        response.raise_for_status()
        return response.json(), None
    except httpx.HTTPStatusError as exc:
        return None, f"{path} answered {exc.response.status_code}"
    except httpx.HTTPError as exc:
        return None, f"unreachable at {url} ({type(exc).__name__})"
    except ValueError:
        return None, f"{path} answered non-JSON"


def read_pool(
    pod: str, role: str, revision: str, url: str | None, internal_token: str | None = None
) -> PodPool:
    """GET <url>/v1/kvpool, with the revision's internal token (an engine that has one
    requires it there). Never raises: an unreachable pod is a PodPool with an error."""
    if url is None:
        return PodPool(pod, role, revision, error="no pod IP yet")
    payload, error = _get_json(url, "/v1/kvpool", internal_token)
    if error is not None:
        return PodPool(pod, role, revision, error=error)
    return parse_pool(pod, role, revision, payload)


def read_load(
    pod: str, role: str, revision: str, url: str | None, internal_token: str | None = None
) -> PodLoad:
    """GET <url>/v1/load (internal token); the reading says when it was read (wall clock)."""
    if url is None:
        return PodLoad(pod, role, revision, error="no pod IP yet")
    payload, error = _get_json(url, "/v1/load", internal_token)
    if error is not None:
        return PodLoad(pod, role, revision, error=error)
    return parse_load(pod, role, revision, payload, read_at=time.time())


def read_tenant_requests(
    url: str, internal_token: str | None, since: float, until: float
) -> TenantRequests | str:
    """GET <router url>/internal/v1/tenant-requests: the requests it answered per tenant in
    [since, until) (unix seconds); why not, as text. Never raises."""
    path = f"/internal/v1/tenant-requests?since={since:.0f}&until={until:.0f}"
    payload, error = _get_json(url, path, internal_token)
    if error is not None:
        return error.replace(path, "/internal/v1/tenant-requests")
    try:
        return TenantRequests.model_validate(payload)
    except ValidationError as exc:
        return f"a malformed answer ({exc.error_count()} errors)"


TenantRequestsReader = Callable[[str, str | None, float, float], "TenantRequests | str"]


@dataclass(frozen=True, slots=True)
class Probe:
    """What to read: the pod, and the instance its report belongs to."""

    pod: str
    role: str
    revision: str
    url: str | None
    token: str | None
    instance: str


class Reading(Protocol):
    @property
    def report(self) -> object | None: ...


R = TypeVar("R", bound=Reading)


@dataclass(slots=True)
class _Entry(Generic[R]):
    found: R | None = None  # the last result: a report, or the last error
    running: Future[R] | None = None
    failures: int = 0
    retry_at: float = 0.0  # the next read: after a failure's back-off, or a refresh
    seen: float = 0.0


@dataclass
class Prober(Generic[R]):
    """`read` one probe (never raising, an error in the reading instead); `failed` the reading
    that says why there is none; `refresh_seconds`: None, a report holds for its container
    instance; else it is read again that long after it was."""

    read: Callable[[Probe], R]
    failed: Callable[[Probe, str], R]
    refresh_seconds: float | None = None
    workers: int = WORKERS
    wait_seconds: float = WAIT_SECONDS
    first_retry_seconds: float = FIRST_RETRY_SECONDS
    max_retry_seconds: float = MAX_RETRY_SECONDS
    clock: Callable[[], float] = time.monotonic
    _entries: dict[Probe, _Entry[R]] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _pool: ThreadPoolExecutor | None = field(default=None, init=False)

    def readings(self, probes: Sequence[Probe]) -> list[R]:
        """Each probe's reading, in order: its report once read, else the last error, else
        `failed(PROBING)`. Starts the reads that are due and waits at most `wait_seconds`
        for them."""
        now = self.clock()
        started: list[Future[R]] = []
        with self._lock:
            for probe in probes:
                entry = self._entries.setdefault(probe, _Entry())
                entry.seen = now
                if entry.running is not None or now < entry.retry_at:
                    continue
                if _has_report(entry.found) and self.refresh_seconds is None:
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
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="engine-probe")
        return self._pool

    def _read(self, probe: Probe) -> R:
        try:
            return self.read(probe)
        except Exception as exc:  # the readers never raise; one that does is a failed read
            return self.failed(probe, f"probe failed: {exc}")

    def _result(self, probe: Probe) -> R:
        entry = self._entries[probe]
        if entry.running is not None and entry.running.done():
            found = entry.running.result()
            entry.running = None
            if _has_report(found) or not _has_report(entry.found):
                entry.found = found
            if _has_report(found):
                entry.failures = 0
                if self.refresh_seconds is not None:
                    entry.retry_at = self.clock() + self.refresh_seconds
            else:
                delay = self.first_retry_seconds * 2**entry.failures
                entry.failures += 1
                entry.retry_at = self.clock() + min(delay, self.max_retry_seconds)
        if entry.found is not None:
            return entry.found
        return self.failed(probe, PROBING)

    def _forget(self, now: float) -> None:
        for key, entry in list(self._entries.items()):
            if entry.running is None and now - entry.seen > FORGET_SECONDS:
                del self._entries[key]


def _has_report(reading: Reading | None) -> bool:
    return reading is not None and reading.report is not None


def pool_prober(read: PoolReader = read_pool, **settings: Any) -> Prober[PodPool]:
    """Pools: read once per container instance."""
    return Prober(
        lambda p: read(p.pod, p.role, p.revision, p.url, p.token),
        lambda p, why: PodPool(p.pod, p.role, p.revision, error=why),
        **settings,
    )


def load_prober(read: LoadReader = read_load, **settings: Any) -> Prober[PodLoad]:
    """Loads: read again every LOAD_REFRESH_SECONDS; a pass never waits for one."""
    settings = {"refresh_seconds": LOAD_REFRESH_SECONDS, "wait_seconds": 0.0, **settings}
    return Prober(
        lambda p: read(p.pod, p.role, p.revision, p.url, p.token),
        lambda p, why: PodLoad(p.pod, p.role, p.revision, error=why),
        **settings,
    )
