"""Leader election on a coordination.k8s.io/v1 Lease, as controller-runtime does it, so that two
operator replicas can run and only one of them reconciles.

The Lease's read-modify-write is the kubernetes client's (`kubernetes.leaderelection`): its
`LeaseLock` (get, create, replace with the resourceVersion it read, so a lost race is a 409)
and `LeaderElection.try_acquire_or_renew` (a lease held by another is taken only after the
record has stayed unchanged for leaseDurationSeconds on this replica's own clock; the leader
keeps acquireTime and moves renewTime). What is ours is the loop around it, because the
library's `run()` does not fit an operator: it runs the payload in a daemon thread and, once
the lease is lost, only calls a callback while that thread goes on writing; its renew calls
have no timeout, so a hung request would let the renew deadline pass unnoticed (and hold a
standby forever); and it cannot be stopped by SIGTERM while standing by. Every Lease request
here ends within half the renew deadline (`TimedApiClient`). Here:

- `campaign()` blocks, trying every retryPeriod, until this replica holds the lease (or
  SIGTERM: `Stopped`). Meanwhile the liveness URL answers, so the kubelet keeps a standby.
- `Leadership.keep()` renews every retryPeriod in a thread; a watchdog exits the process
  (status 1, one line on stderr) once renewDeadline has passed since the start of the last
  renewal that succeeded, whether the renewals fail or hang. A follower takes the lease no
  sooner than leaseDurationSeconds after it saw that renewal, later than the leader stopped:
  never two writers. The kubelet restarts the exited replica, which stands by.
- `Leadership.release()`, after kopf stopped on SIGTERM: the lease is emptied (no holder), so
  the standby takes it at its next try instead of waiting out the lease (a rolling update).

kopf's own peering stays off: same-priority peers both run, which is not leader election.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from kubernetes.client import ApiClient, Configuration, CoordinationV1Api
from kubernetes.leaderelection.electionconfig import Config
from kubernetes.leaderelection.leaderelection import LeaderElection
from kubernetes.leaderelection.leaderelectionrecord import LeaderElectionRecord
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

logger = logging.getLogger("kvfence.leader")

# controller-runtime's defaults.
LEASE_DURATION = 15
RENEW_DEADLINE = 10
RETRY_PERIOD = 2
POD_NAME_ENV = "POD_NAME"


class Stopped(Exception):
    """SIGTERM or SIGINT while standing by."""


def default_identity() -> str:
    """The pod's name (the chart sets POD_NAME from the downward API). Elsewhere the host name
    and a random suffix, as controller-runtime does: two processes on one host must differ, or
    each would take the other's lease for its own."""
    return os.environ.get(POD_NAME_ENV) or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class TimedApiClient(ApiClient):
    """An ApiClient whose every request ends within `seconds` (connect and read), where the
    caller gave no `_request_timeout` of its own: one try, no urllib3 retries (three by
    default, each with the whole timeout). The election's own loop is the retry."""

    def __init__(self, seconds: float) -> None:
        configuration = Configuration.get_default_copy()
        configuration.retries = False
        super().__init__(configuration)
        self.seconds = seconds

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = self.seconds
        return super().call_api(*args, **kwargs)


@dataclass
class Election:
    lease: str
    namespace: str
    identity: str
    lease_duration: int = LEASE_DURATION
    renew_deadline: int = RENEW_DEADLINE
    retry_period: int = RETRY_PERIOD
    _election: LeaderElection = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lock = LeaseLock(self.lease, self.namespace, self.identity)
        # The library's calls pass no timeout: a request that hangs (a partition that drops
        # packets) would hold a standby forever, deaf to SIGTERM. Half the renew deadline
        # leaves a leader time for one more try before its watchdog gives up.
        lock.api_instance = CoordinationV1Api(TimedApiClient(self.renew_deadline / 2))
        # The library's Config checks the durations (lease > deadline > 1.2 x retry) itself.
        config = Config(
            lock,
            self.lease_duration,
            self.renew_deadline,
            self.retry_period,
            onstarted_leading=lambda: None,
            onstopped_leading=None,
        )
        self._election = LeaderElection(config)

    def try_once(self) -> bool:
        """One get-and-write of the Lease: True when this replica holds it afterwards."""
        try:
            return bool(self._election.try_acquire_or_renew())
        except Exception as exc:  # a refused connection, a body the client cannot read
            logger.warning("leader election: lease %s: %s", self.where, exc)
            return False

    def holder(self) -> str | None:
        """Who held the lease at the last read (None: nobody, or not read yet)."""
        record = self._election.observed_record
        return record.holder_identity if record is not None else None

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.lease}"

    def campaign(self, liveness: str | None = None) -> Leadership:
        """Block until this replica holds the lease; SIGTERM or SIGINT raise `Stopped`."""
        logger.info("leader election: %s stands by for lease %s", self.identity, self.where)
        with _stop_on_signals() as stop, _standby_liveness(liveness):
            while True:
                started = time.monotonic()
                if self.try_once():
                    break
                if stop.wait(self.retry_period):
                    raise Stopped
        logger.info("leader election: %s leads (lease %s)", self.identity, self.where)
        return Leadership(self, renewed_at=started)

    def release(self) -> bool:
        """Empty the lease if this replica still holds it (a 409 if it changed meanwhile)."""
        lock = self._election.election_config.lock
        found, record = lock.get(self.lease, self.namespace)
        if not found or record is None or record.holder_identity != self.identity:
            return False
        now = str(datetime.now())
        return bool(
            lock.update(self.lease, self.namespace, LeaderElectionRecord(None, "1", now, now))
        )


@dataclass
class Leadership:
    election: Election
    renewed_at: float  # time.monotonic() at the start of the last renewal that succeeded
    on_lost: Callable[[str], None] = field(default=lambda why: _exit_lost(why))
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False)

    def keep(self) -> None:
        """Renew in the background; lose the lease and `on_lost` runs at once."""
        for target in (self._renew, self._watch):
            thread = threading.Thread(target=target, name=f"leader-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _renew(self) -> None:
        election = self.election
        while not self._stop.wait(election.retry_period):
            started = time.monotonic()
            if election.try_once():
                self.renewed_at = max(self.renewed_at, started)
            elif election.holder() not in (None, election.identity):
                self.on_lost(f"lease {election.where} is held by {election.holder()}")
                return

    def _watch(self) -> None:
        deadline = self.election.renew_deadline
        while not self._stop.wait(0.2):
            late = time.monotonic() - self.renewed_at
            if late > deadline:
                self.on_lost(
                    f"lease {self.election.where} not renewed for {late:.1f} s "
                    f"(renew deadline {deadline} s)"
                )
                return

    def release(self) -> None:
        """Stop renewing, then hand the lease back (after kopf stopped writing)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.election.retry_period + 5)
        try:
            if self.election.release():
                logger.info("leader election: released lease %s", self.election.where)
        except Exception as exc:  # the standby then waits out the lease instead
            logger.warning(
                "leader election: could not release lease %s: %s", self.election.where, exc
            )


def _exit_lost(why: str) -> None:
    # No cleanup, no kopf shutdown: every moment another replica may be leading.
    print(f"kvfence operator: lost leadership: {why}; exiting", file=sys.stderr, flush=True)
    os._exit(1)


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    stop = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _standby_liveness(url: str | None) -> Iterator[None]:
    """Answer kopf's liveness URL while kopf is not running yet: a standby is alive."""
    if not url:
        yield
        return
    parts = urlsplit(url)
    path = parts.path or "/"

    class Alive(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path.split("?")[0] == path
            body = b'{"leader": false}\n' if ok else b""
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((parts.hostname or "0.0.0.0", parts.port or 80), Alive)
    thread = threading.Thread(target=server.serve_forever, name="standby-liveness", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
