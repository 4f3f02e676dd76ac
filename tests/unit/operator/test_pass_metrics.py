"""The operator's pass counter and pass durations (`kvfence operator --metrics URL`,
app/metrics.py): every pass of the kopf timer is counted for its InferenceDeployment when it
ends, however it ends, and the metrics are served at the URL's path."""

import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import kopf
import pytest
from kopf._core.engines import posting
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helpers.memory_kube import MemoryKube
from helpers.reconciling import body, never_probed, run_timer
from kvfence_engine.tools.localproc import free_port
from kvfence_operator.app.metrics import (
    CANARY_RUNS,
    CURRENT_REPLICAS,
    DESIRED_REPLICAS,
    ISOLATION_VERIFIED,
    PASS_SECONDS,
    PASSES,
    SIGNAL_TARGET,
    SIGNAL_VALUE,
    STATUS_CONDITION,
    PassMetrics,
    parse_metrics_url,
    serve_metrics,
)
from kvfence_operator.crd.types import AutoscalingStatus, InferenceDeploymentStatus
from kvfence_operator.decisions.findings import CredentialsUnreadable
from kvfence_operator.reconcile.reconciler import Reconciler

KEYS = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys"}, "data": {}}


@pytest.fixture(autouse=True)
def no_event_posting() -> Iterator[None]:
    """kopf.event outside a running operator: posting off, as kopf's own tests do it."""
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    token = posting.settings_var.set(settings)
    yield
    posting.settings_var.reset(token)


class Raising:
    """A reconciler whose pass stops with `error` (the real ones are tested where they are
    raised: test_derived_credentials.py, test_crd_validation.py)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def reconcile(self, body: Any) -> Any:
        raise self.error


def samples(metrics: PassMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    found = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def passes(metrics: PassMetrics, namespace: str, name: str) -> float:
    key = (("name", name), ("namespace", namespace))
    return samples(metrics, f"{PASSES}_total").get(key, 0.0)


def timed(metrics: PassMetrics, outcome: str) -> float:
    return samples(metrics, f"{PASS_SECONDS}_count").get((("outcome", outcome),), 0.0)


def test_every_pass_is_counted_for_its_object_whatever_its_outcome():
    metrics = PassMetrics()
    reconciler = Reconciler(MemoryKube(KEYS), "kvfence-system", read_pool=never_probed)
    memo = kopf.Memo(reconciler=reconciler, metrics=metrics)

    run_timer(memo, body())
    run_timer(memo, body())
    assert passes(metrics, "default", "tiny") == 2
    assert timed(metrics, "reconciled") == 2

    # a spec the CRD let through: InvalidSpec, kopf told to stop retrying, counted all the same
    invalid = body()
    invalid["spec"]["contextLength"] = "long"
    with pytest.raises(kopf.PermanentError, match="invalid spec"):
        run_timer(memo, invalid)
    assert passes(metrics, "default", "tiny") == 3
    assert timed(metrics, "invalid_spec") == 1

    # another object's passes are its own
    other = body()
    other["metadata"] = {**other["metadata"], "name": "other", "namespace": "team-a"}
    unreadable = CredentialsUnreadable("0123456789", "tiny-0123456789-credentials")
    patch = run_timer(kopf.Memo(reconciler=Raising(unreadable), metrics=metrics), other)
    assert patch.status["conditions"], "Degraded says CredentialsUnreadable"
    assert passes(metrics, "team-a", "other") == 1
    assert timed(metrics, "credentials_unreadable") == 1

    # a pass that breaks (kopf retries it) ended too
    with pytest.raises(RuntimeError, match="the API went away"):
        run_timer(kopf.Memo(reconciler=Raising(RuntimeError("the API went away")), metrics=metrics),
                 other)  # fmt: skip
    assert passes(metrics, "team-a", "other") == 2
    assert timed(metrics, "error") == 1
    assert passes(metrics, "default", "tiny") == 3


def test_the_metrics_are_served_at_the_urls_path_only():
    metrics = PassMetrics()
    metrics.passes.labels(namespace="default", name="tiny").inc(3)
    url = f"http://127.0.0.1:{free_port()}/metrics"
    server = serve_metrics(metrics, url)
    try:
        answer = httpx.get(url)
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/plain")
        (family,) = [f for f in text_string_to_metric_families(answer.text) if f.name == PASSES]
        (sample,) = [s for s in family.samples if s.name == f"{PASSES}_total"]
        assert sample.labels == {"namespace": "default", "name": "tiny"} and sample.value == 3
        assert PASS_SECONDS in {f.name for f in text_string_to_metric_families(answer.text)}
        assert httpx.get(url.replace("/metrics", "/other")).status_code == 404
        # the address is taken while it serves: a second operator is told so
        with pytest.raises(OSError):
            serve_metrics(PassMetrics(), url)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "url", ["127.0.0.1:9090/metrics", "https://0.0.0.0:9090/metrics", "http://0.0.0.0/metrics",
            "http://0.0.0.0:9090", "http://0.0.0.0:port/metrics"],
)  # fmt: skip
def test_a_metrics_url_that_is_not_http_host_port_path_is_refused_with_an_example(url):
    with pytest.raises(ValueError, match=r"give http://HOST:PORT/PATH, e\.g\. http://0\.0\.0\.0"):
        parse_metrics_url(url)
    assert parse_metrics_url("http://0.0.0.0:9090/metrics") == ("0.0.0.0", 9090, "/metrics")


def test_the_autoscalers_decision_and_its_inputs_are_metrics():
    metrics = PassMetrics()
    status = AutoscalingStatus.model_validate({
        "mode": "Operator",
        "decode": {"current": 3, "desired": 2, "signal": "RunningSequences", "value": 3.5,
                   "target": 8},
    })  # fmt: skip
    metrics.scaling("default", "tiny", status)
    metrics.scaling("default", "other", None)  # no autoscaling: no series
    labels = {"namespace": "default", "name": "tiny", "role": "decode"}
    sample = metrics.registry.get_sample_value
    assert sample(DESIRED_REPLICAS, labels) == 2
    assert sample(CURRENT_REPLICAS, labels) == 3
    signal = {**labels, "signal": "RunningSequences"}
    assert (sample(SIGNAL_VALUE, signal), sample(SIGNAL_TARGET, signal)) == (3.5, 8)
    assert sample(DESIRED_REPLICAS, {**labels, "role": "prefill"}) is None


def _statuses(*steps: dict[str, Any]) -> list[InferenceDeploymentStatus]:
    return [InferenceDeploymentStatus.model_validate(s) for s in steps]


def _run(job: str, result: str) -> dict[str, Any]:
    return {"standingCanary": {"revision": "r1", "schedule": "@every 60s", "lastRun": {
        "job": job, "startTime": "2026-12-07T12:00:00Z", "result": result}}}  # fmt: skip


def test_each_canary_verdict_is_counted_once_by_the_pass_that_records_it() -> None:
    """kvfence_canary_runs_total: a run's verdict counts when a status first records it, not
    again on the passes after (nor after an operator restart, which reads the same status)."""
    metrics = PassMetrics()
    rollout = {"canary": {"revision": "r1", "jobUid": "u1", "result": "Passed"}}
    steps = _statuses(
        {},
        {"canary": {"revision": "r1", "jobUid": "u1", "result": "Running"}},
        rollout,
        rollout,  # the next pass: the same verdict
        {**rollout, **_run("w1", "Running")},
        {**rollout, **_run("w1", "Failed")},
        {**rollout, **_run("w1", "Failed")},
        {**rollout, **_run("w2", "Running")},
        {**rollout, **_run("w2", "Passed")},
        {**rollout, **_run("w3", "CouldNotRun")},  # a run that ended between two passes
    )
    for previous, status in itertools.pairwise(steps):
        metrics.canaries("team", "tiny", previous, status)
    counted = {
        (s.labels["kind"], s.labels["verdict"]): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        if family.name == CANARY_RUNS
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert counted == {
        ("rollout", "passed"): 1,
        ("standing", "failed"): 1,
        ("standing", "passed"): 1,
        ("standing", "could_not_run"): 1,
    }


def test_the_isolation_gauge_follows_the_condition_and_goes_with_the_schedule() -> None:
    metrics = PassMetrics()

    def gauge() -> float | None:
        return metrics.registry.get_sample_value(
            ISOLATION_VERIFIED, {"namespace": "team", "name": "tiny"}
        )

    def verified(status: str) -> InferenceDeploymentStatus:
        condition = {"type": "IsolationVerified", "status": status, "reason": "R", "message": "",
                     "lastTransitionTime": "2026-12-07T12:00:00Z"}  # fmt: skip
        return InferenceDeploymentStatus.model_validate({"conditions": [condition]})

    empty = InferenceDeploymentStatus()
    metrics.canaries("team", "tiny", empty, verified("True"))
    assert gauge() == 1
    metrics.canaries("team", "tiny", empty, verified("False"))
    assert gauge() == 0
    metrics.canaries("team", "tiny", empty, verified("Unknown"))
    assert gauge() == 0
    metrics.canaries("team", "tiny", empty, empty)  # the schedule was removed
    assert gauge() is None


def test_each_condition_is_exported_with_its_status_one_and_the_others_zero() -> None:
    """kvfence_status_condition, kube-state-metrics' way: what the alerts on a closed pool
    gate (PoolSufficient False) and a stuck rollout (Stalled True) read."""
    metrics = PassMetrics()
    stamp = "2026-12-07T12:00:00Z"
    status = InferenceDeploymentStatus.model_validate(
        {
            "conditions": [
                {"type": "PoolSufficient", "status": "False", "reason": "PoolTooSmall",
                 "message": "", "lastTransitionTime": stamp},
                {"type": "Stalled", "status": "True", "reason": "PoolInsufficient",
                 "message": "", "lastTransitionTime": stamp},
            ]
        }
    )  # fmt: skip
    metrics.conditions("team", "tiny", status)

    def value(condition: str, said: str) -> float | None:
        labels = {"namespace": "team", "name": "tiny", "condition": condition, "status": said}
        return metrics.registry.get_sample_value(STATUS_CONDITION, labels)

    assert [value("PoolSufficient", s) for s in ("True", "False", "Unknown")] == [0, 1, 0]
    assert [value("Stalled", s) for s in ("True", "False", "Unknown")] == [1, 0, 0]
