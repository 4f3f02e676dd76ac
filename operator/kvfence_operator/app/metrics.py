"""The operator's own Prometheus metrics (`kvfence operator --metrics URL`): how many reconcile
passes each InferenceDeployment has had and how long passes take, and the autoscaler's
decisions with their inputs (the signal's value and target, the replicas decided and running).

A pass is counted when it ends, whatever its outcome: a status written or not, an
InvalidSpec or CredentialsUnreadable finding, or an error kopf retries. The counter is also
how a test waits for "N more passes" of the operator instead of sleeping
(tests/helpers/operators.py). The registry is the operator's own (not prometheus-client's
global one), so that a test can count the passes of one handler call."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from enum import StrEnum
from http.server import ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import MetricsHandler

from kvfence_operator.crd.types import (
    AutoscalingStatus,
    CanaryResult,
    ConditionStatus,
    ConditionType,
    InferenceDeploymentStatus,
)

PASSES = "kvfence_operator_reconcile_passes"  # exposed with _total, as every counter
PASS_SECONDS = "kvfence_operator_reconcile_pass_seconds"
DESIRED_REPLICAS = "kvfence_desired_replicas"
CURRENT_REPLICAS = "kvfence_current_replicas"
SIGNAL_VALUE = "kvfence_autoscaling_signal_value"
SIGNAL_TARGET = "kvfence_autoscaling_signal_target"
CANARY_RUNS = "kvfence_canary_runs"
ISOLATION_VERIFIED = "kvfence_isolation_verified"
STATUS_CONDITION = "kvfence_status_condition"
CONDITION_STATUSES = ("True", "False", "Unknown")
VERDICTS = {
    CanaryResult.PASSED: "passed",
    CanaryResult.FAILED: "failed",
    CanaryResult.COULD_NOT_RUN: "could_not_run",
}
# A pass reads caches and writes what differs: tens of milliseconds; probes and pushes to
# slow pods take it to seconds.
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PassOutcome(StrEnum):
    RECONCILED = "reconciled"  # the whole pass ran (its status written if it changed)
    INVALID_SPEC = "invalid_spec"  # stopped at the spec: kopf.PermanentError
    CREDENTIALS_UNREADABLE = "credentials_unreadable"  # stopped before probing or gating
    CRD_OUTDATED = "crd_outdated"  # stopped before reading anything: the CRD is older
    ERROR = "error"  # an exception kopf retries


@dataclass
class PassMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.passes = Counter(
            PASSES,
            "Reconcile passes that ended, per InferenceDeployment, whatever their outcome",
            ["namespace", "name"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            PASS_SECONDS,
            "How long a reconcile pass took, by how it ended",
            ["outcome"],
            buckets=PASS_BUCKETS,
            registry=self.registry,
        )
        role = ["namespace", "name", "role"]
        self.desired = Gauge(
            DESIRED_REPLICAS, "Replicas the autoscaler decided, per role", role,
            registry=self.registry,
        )  # fmt: skip
        self.current = Gauge(
            CURRENT_REPLICAS, "Replicas the serving revision's Deployment runs, per role", role,
            registry=self.registry,
        )  # fmt: skip
        self.value = Gauge(
            SIGNAL_VALUE, "The value of the signal a role scales on (per pod, or the pods')",
            [*role, "signal"], registry=self.registry,
        )  # fmt: skip
        self.target = Gauge(
            SIGNAL_TARGET, "The target of the signal a role scales on", [*role, "signal"],
            registry=self.registry,
        )  # fmt: skip

        self.canary_runs = Counter(
            CANARY_RUNS,
            "Canary runs that ended, by kind (rollout: a candidate's, before promotion; "
            "standing: on spec.canary.schedule, against the serving revision) and verdict",
            ["namespace", "name", "kind", "verdict"],
            registry=self.registry,
        )
        self.isolation = Gauge(
            ISOLATION_VERIFIED,
            "1 while the IsolationVerified condition is True, 0 while it is False or Unknown "
            "(present only with spec.canary.schedule)",
            ["namespace", "name"],
            registry=self.registry,
        )
        self.condition = Gauge(
            STATUS_CONDITION,
            "The InferenceDeployment's conditions, kube-state-metrics' way: 1 for the status "
            "each condition has, 0 for the other two",
            ["namespace", "name", "condition", "status"],
            registry=self.registry,
        )

    def conditions(self, namespace: str, name: str, status: InferenceDeploymentStatus) -> None:
        """The conditions the pass that just ended wrote."""
        for condition in status.conditions:
            for value in CONDITION_STATUSES:
                labels = (namespace, name, condition.type, value)
                self.condition.labels(*labels).set(condition.status == value)

    def canaries(
        self,
        namespace: str,
        name: str,
        previous: InferenceDeploymentStatus,
        status: InferenceDeploymentStatus,
    ) -> None:
        """The verdicts the pass that just ended recorded, and IsolationVerified."""
        for kind, verdict in new_verdicts(previous, status):
            self.canary_runs.labels(namespace, name, kind, verdict).inc()
        verified = next(
            (c for c in status.conditions if c.type == ConditionType.ISOLATION_VERIFIED), None
        )
        if verified is None:
            with suppress(KeyError):  # never set: nothing to remove
                self.isolation.remove(namespace, name)
        else:
            self.isolation.labels(namespace, name).set(verified.status is ConditionStatus.TRUE)

    def scaling(self, namespace: str, name: str, status: AutoscalingStatus | None) -> None:
        """The autoscaler's decision of the pass that just ended, per scaled role."""
        for role in ("prefill", "decode"):
            scaled = getattr(status, role, None) if status is not None else None
            if scaled is None:
                continue
            labels = {"namespace": namespace, "name": name, "role": role}
            self.current.labels(**labels).set(scaled.current)
            if scaled.desired is not None:
                self.desired.labels(**labels).set(scaled.desired)
            if scaled.signal is not None:
                signal = {**labels, "signal": str(scaled.signal)}
                if scaled.value is not None:
                    self.value.labels(**signal).set(scaled.value)
                if scaled.target is not None:
                    self.target.labels(**signal).set(scaled.target)

    @contextmanager
    def counting(self, namespace: str, name: str) -> Iterator["PassRecord"]:
        """Count one pass of `namespace/name`; the body sets `record.outcome` where it ends
        otherwise than RECONCILED, and an exception is an ERROR."""
        record = PassRecord()
        started = time.monotonic()
        try:
            yield record
        except BaseException:
            if record.outcome is PassOutcome.RECONCILED:
                record.outcome = PassOutcome.ERROR
            raise
        finally:
            self.seconds.labels(outcome=record.outcome).observe(time.monotonic() - started)
            self.passes.labels(namespace=namespace, name=name).inc()


def new_verdicts(
    previous: InferenceDeploymentStatus, status: InferenceDeploymentStatus
) -> list[tuple[str, str]]:
    """(kind, verdict) of each canary run whose verdict `status` records and `previous` did
    not: each run counted once, by the pass that wrote its verdict."""
    found = []
    old, new = previous.canary, status.canary
    if new is not None and new.result in VERDICTS:
        seen = old is not None and old.job_uid == new.job_uid and old.result == new.result
        if not seen:
            found.append(("rollout", VERDICTS[new.result]))
    before = previous.standing_canary.last_run if previous.standing_canary else None
    run = status.standing_canary.last_run if status.standing_canary else None
    fresh = before is None or run is None or (before.job, before.result) != (run.job, run.result)
    if run is not None and run.result in VERDICTS and fresh:
        found.append(("standing", VERDICTS[run.result]))
    return found


@dataclass
class PassRecord:
    outcome: PassOutcome = PassOutcome.RECONCILED


def operator_metrics() -> PassMetrics:
    """The running operator's: the pass metrics and the process's (CPU, memory, open files)."""
    metrics = PassMetrics()
    ProcessCollector(registry=metrics.registry)
    return metrics


def parse_metrics_url(url: str) -> tuple[str, int, str]:
    """`http://HOST:PORT/PATH` -> (host, port, path); a ValueError a user can act on."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or not parts.path:
        raise ValueError(
            f"--metrics {url!r}: give http://HOST:PORT/PATH, e.g. http://0.0.0.0:9090/metrics"
        )
    return parts.hostname, port, parts.path


def serve_metrics(metrics: PassMetrics, url: str) -> ThreadingHTTPServer:
    """Serve `metrics` at `url` (GET on its path; 404 elsewhere) from a daemon thread, as long
    as the process runs. An address in use is an OSError, raised here."""
    host, port, path = parse_metrics_url(url)

    class Handler(MetricsHandler):
        registry = metrics.registry

        def do_GET(self) -> None:
            if urlsplit(self.path).path != path:
                self.send_error(404, f"metrics are at {path}")
                return
            super().do_GET()

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
