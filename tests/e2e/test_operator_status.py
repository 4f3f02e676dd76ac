"""The status says true things (issue 14, item 5), end to end: `kvfence operator` against the
test cluster, on hollow pods (kvfence_devcluster/hollow.py): what is tested is what the
operator writes, not what the engines serve."""

from typing import Any

import pytest

from helpers.operators import start_operator
from helpers.tiny_infd import (
    NAME,
    api_keys_secret,
    condition,
    engine_pods,
    engine_urls,
    events,
    hollow_canary_flags,
    infd,
    manifest,
    revision_of_manifest,
    routed_to,
    update_spec,
    wait_condition,
    with_max_num_seqs,
)
from helpers.waits import READY_S
from kvfence_devcluster.fixtures import start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_operator.meta import KV_POOL_GATE, LABEL_REVISION

pytestmark = pytest.mark.hollow


def test_reverting_the_spec_after_a_failed_canary_says_the_serving_revision_passed(tmp_path):
    bad = with_max_num_seqs("16")
    bad_revision = revision_of_manifest(bad)
    options = KubeletOptions(
        hollow=True,
        amend_argv=hollow_canary_flags(bad_revision, lambda: ["--hollow-verdict", "fail"]),
    )
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        cluster.create(api_keys_secret())
        operator = start_operator(cluster)
        first = cluster.create(manifest())
        r1 = revision_of_manifest(first)
        wait_condition(cluster, "Ready", "True", timeout=READY_S)

        update_spec(cluster, bad["spec"])
        failed = wait_condition(cluster, "CanaryPassed", "False", timeout=READY_S)
        assert failed["status"]["revision"] == {"current": r1, "candidate": bad_revision}
        assert condition(failed, "Stalled")["reason"] == "CanaryFailed"

        # The user reverts: r1 serves, and it passed its canary to be serving.
        update_spec(cluster, first["spec"])
        passed = wait_condition(cluster, "CanaryPassed", "True", timeout=60, reason="CanaryPassed")
        status = passed["status"]
        assert status["revision"] == {"current": r1}
        assert status["canary"]["revision"] == r1 and status["canary"]["result"] == "Passed"
        assert r1 in condition(passed, "CanaryPassed")["message"]
        settled = wait_condition(cluster, "Degraded", "False", timeout=60)
        for kind, value in (("Ready", "True"), ("Stalled", "False"), ("Progressing", "False")):
            assert condition(settled, kind)["status"] == value, (kind, condition(settled, kind))
        cluster.wait_for(
            lambda: cluster.list("Deployment", "default", {LABEL_REVISION: bad_revision}),
            "the reverted revision's Deployments to be removed",
            until=lambda found: found == [],
        )
        operator.stop()
        assert not cluster.problems()


def test_an_evicted_engine_pod_is_ignored_and_the_serving_revision_stays_ready(cluster):
    cluster.create(api_keys_secret())
    operator = start_operator(cluster)
    created = cluster.create(manifest())
    r1 = revision_of_manifest(created)
    wait_condition(cluster, "Ready", "True", timeout=READY_S)

    (decode,) = [
        p
        for p in engine_pods(cluster, r1)
        if p["metadata"]["labels"]["kvfence.dev/role"] == "decode"
    ]
    evicted = decode["metadata"]["name"]
    evicted_url = cluster.pod_url(decode)
    cluster.patch(
        "Pod",
        evicted,
        {
            "status": {
                "phase": "Failed",
                "reason": "Evicted",
                "message": "The node was low on resource: memory.",
                "podIP": None,
                "podIPs": None,
            }
        },
        subresource="status",
    )
    stalled: list[dict[str, Any]] = []

    def serving_again() -> dict[str, Any]:
        obj = infd(cluster)
        if condition(obj, "Stalled").get("status") == "True":
            stalled.append(condition(obj, "Stalled"))
        return obj

    def replaced(obj: dict[str, Any]) -> bool:
        pools = {p["pod"] for p in obj["status"].get("pools") or []}
        return (
            condition(obj, "Ready").get("status") == "True"
            and evicted not in pools
            and any(p.startswith(f"{NAME}-{r1}-decode") for p in pools)
        )

    ready = cluster.wait_for(serving_again, "Ready with the replacement pod", 180, until=replaced)
    assert cluster.get("Pod", evicted) is not None  # still there, until pod GC
    assert ready["status"]["decode"]["summary"] == "1/1"
    assert not stalled, stalled  # a replaced pod is progress, never a stall
    # ignored: not gated again, not a backend
    assert cluster.get("Pod", evicted)["status"]["phase"] == "Failed"
    gate = cluster.pod_condition(cluster.get("Pod", evicted), KV_POOL_GATE)
    assert gate is None or gate["status"] == "True"  # as it was before the eviction
    routes = cluster.wait_for(
        lambda: routed_to(cluster, r1),
        "the router to route to the replacement decode pod",
        until=lambda routed: routed == engine_urls(cluster, r1),
    )
    assert evicted_url not in routes["decode"] and len(routes["decode"]) == 1
    operator.wait_passes(3, NAME)  # more passes with the evicted pod still there
    assert condition(infd(cluster), "Ready")["status"] == "True"
    assert routed_to(cluster, r1) == routes
    operator.stop()
    assert not cluster.problems()


def test_a_missing_api_keys_secret_is_degraded_with_one_event_then_serves_once_created(cluster):
    operator = start_operator(cluster)
    cluster.create(manifest())
    degraded = wait_condition(
        cluster, "Degraded", "True", timeout=60, reason="ApiKeysSecretMissing"
    )
    message = condition(degraded, "Degraded")["message"]
    assert f"Secret {NAME}-keys (spec.router.apiKeysSecret) does not exist" in message, message
    assert condition(degraded, "Ready")["status"] == "False"
    # the pass goes on: the revision's children are made; its routers wait for the Secret
    cluster.wait_for(
        lambda: cluster.list("Deployment", "default", {"app.kubernetes.io/instance": NAME}),
        "the revision's Deployments",
        until=lambda found: len(found) == 3,
    )
    cluster.wait_for(lambda: events(cluster, "ApiKeysSecretMissing"), "the Warning Event")
    operator.wait_passes(4, NAME)  # one Event when the error appears, not one a pass
    (event,) = events(cluster, "ApiKeysSecretMissing")
    assert event["type"] == "Warning" and event["message"] == message

    cluster.create(api_keys_secret())
    ready = wait_condition(cluster, "Ready", "True", timeout=READY_S)
    assert condition(ready, "Degraded")["status"] == "False"
    operator.stop()
    assert not cluster.problems()
