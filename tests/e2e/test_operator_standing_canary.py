"""The standing canary end to end (spec.canary.schedule): `kvfence operator` against the test
cluster, whose kubelet runs every pod as a real engine, router or canary process with
builtin:tiny-random. A healthy revision passes its standing runs; a fault switched on in its
running decode engine afterwards (the test-only POST /internal/unsafe-fault, as a node going bad
after its rollout) fails the next run, and the status, an Event and the operator's metrics say
so, with the window in which tenants may have been exposed."""

import re
from datetime import datetime
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.operators import Operator, start_operator
from helpers.tiny_infd import (
    NAME,
    api_keys_secret,
    check_first_rollout,
    complete,
    condition,
    engine_pods,
    infd,
    internal_token,
    manifest,
    revision_of_manifest,
    routed_to,
    wait_condition,
    wait_events,
)
from helpers.waits import READY_S
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.tools import http_clients
from kvfence_operator.meta import KV_POOL_GATE, LABEL_ROLE

MAX_REQUESTS = 200
RATE = 20.0  # requests a second: a run of ~100 requests is bounded to ~5 s of sending
STANDING = {"schedule": "@every 10s", "onFailure": "Quarantine",
            "standingLoad": {"maxRequests": MAX_REQUESTS, "requestsPerSecond": RATE}}  # fmt: skip


def canary_runs(operator: Operator) -> dict[tuple[str, str], float]:
    """kvfence_canary_runs_total of `tiny`, by (kind, verdict)."""
    text = http_clients.get(operator.metrics_url, timeout=5).raise_for_status().text
    return {
        (s.labels["kind"], s.labels["verdict"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvfence_canary_runs"
        for s in family.samples
        if s.name.endswith("_total") and s.labels.get("name") == NAME
    }


def isolation_gauge(operator: Operator) -> float | None:
    text = http_clients.get(operator.metrics_url, timeout=5).raise_for_status().text
    return next(
        (
            s.value
            for family in text_string_to_metric_families(text)
            if family.name == "kvfence_isolation_verified"
            for s in family.samples
            if s.labels.get("name") == NAME
        ),
        None,
    )


def decode_pod(cluster: Cluster, revision: str) -> dict[str, Any]:
    pods = engine_pods(cluster, revision)
    (decode,) = [p for p in pods if p["metadata"]["labels"][LABEL_ROLE] == "decode"]
    return decode


def switch_on_early_release(cluster: Cluster, revision: str) -> None:
    decode = decode_pod(cluster, revision)
    answer = httpx.post(
        cluster.pod_url(decode) + "/internal/unsafe-fault",
        json={"fault": "early-release"},
        headers={TOKEN_HEADER: internal_token(cluster, revision)},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"unsafe_faults": ["early-release"]}


@pytest.mark.slow
def test_the_standing_canary_passes_a_healthy_revision_and_catches_a_fault_switched_on_later(
    tmp_path,
):
    with start_cluster(tmp_path / "cluster") as cluster:
        cluster.create(api_keys_secret())
        operator = start_operator(cluster)
        created = cluster.create(manifest(canary={"timeoutSeconds": 120, **STANDING}))
        revision = revision_of_manifest(created)
        check_first_rollout(cluster, created, revision)

        # healthy: a standing run passes, within its load bounds
        passed = wait_condition(
            cluster, "IsolationVerified", "True", timeout=READY_S, reason="StandingCanaryPassed"
        )
        watch = passed["status"]["standingCanary"]
        assert watch["revision"] == revision and watch["schedule"] == "@every 10s"
        # lastRun may already be the next run (a run longer than the schedule's period is
        # followed by the next in the same pass), so the passed run is read from its Event
        job = watch["lastPassedJob"]
        assert job.startswith(f"{NAME}-{revision}-watch")
        (told,) = wait_events(cluster, "StandingCanaryPassed", job)
        said = re.search(r"\((\d+) requests\)", told["message"])
        assert said is not None, told["message"]
        sent = int(said.group(1))
        assert 0 < sent <= MAX_REQUESTS, told["message"]
        assert canary_runs(operator).get(("standing", "passed"), 0) >= 1
        assert canary_runs(operator).get(("rollout", "passed")) == 1
        assert isolation_gauge(operator) == 1
        assert complete(cluster, revision) == 2  # users are served beside it

        # the decode engine goes bad after its rollout: the next run fails on it
        switch_on_early_release(cluster, revision)
        failed = wait_condition(
            cluster, "IsolationVerified", "False", timeout=READY_S, reason="StandingCanaryFailed"
        )
        watch = failed["status"]["standingCanary"]
        failure = watch["lastFailure"]
        message = condition(failed, "IsolationVerified")["message"]
        assert failure["job"] in message and "FAIL" in failure["message"]
        assert failure["message"] in message
        # the window: from the start of the last run that passed to the failing verdict
        since = datetime.fromisoformat(failure["exposureSince"])
        until = datetime.fromisoformat(failure["time"])
        assert since == datetime.fromisoformat(watch["lastPassedTime"]) < until
        assert failure["exposureSince"].replace("+00:00", "Z") in message
        (event,) = wait_events(cluster, "StandingCanaryFailed", failure["job"])
        assert event["type"] == "Warning" and "may have been exposed" in event["message"]
        # whom to tell: the user's tenant was answered in the window; the canary's are left out
        assert failure["tenants"].get("team-a", 0) >= 1, failure
        assert not any(t.startswith("kvfence-canary") for t in failure["tenants"])
        assert failure["tenantsRead"].startswith("1 of 1 routers read")
        (exposed,) = wait_events(cluster, "ExposedTenants", failure["job"])
        assert exposed["type"] == "Warning" and "team-a (" in exposed["message"]
        assert canary_runs(operator).get(("standing", "failed"), 0) >= 1  # later runs may too
        assert isolation_gauge(operator) == 0
        # the rollout's verdict is untouched
        assert infd(cluster)["status"]["canary"]["result"] == "Passed"

        # Quarantine: the decode pod whose counters rose leaves the routers, kept for inspection
        decode = decode_pod(cluster, revision)["metadata"]["name"]
        assert watch["quarantined"] == [decode]
        # and the pod's gate's own Event, that it stopped taking traffic
        (quarantined,) = wait_events(cluster, "Quarantined", "left the routers")
        assert quarantined["type"] == "Warning" and decode in quarantined["message"]
        gate = cluster.wait_for(
            lambda: cluster.pod_condition(decode_pod(cluster, revision), KV_POOL_GATE),
            "the decode pod's kv-pool gate to close",
            until=lambda c: (c or {}).get("status") == "False",
        )
        assert gate is not None and gate["reason"] == "Quarantined"
        cluster.wait_for(
            lambda: routed_to(cluster, revision),
            "the router to route to no decode engine",
            until=lambda routed: routed["decode"] == [],
        )
        with pytest.raises(openai.APIStatusError) as refused:  # fails closed: nothing decodes
            complete(cluster, revision)
        assert refused.value.status_code == 503
        operator.stop()
        assert not cluster.problems()
