"""The operator end to end: `kvfence operator` (kopf) against the test cluster. Where a canary
or serving is the subject, its kubelet runs every pod as a real engine, router or canary
process with builtin:tiny-random; the tests of what the operator decides and writes
(`@pytest.mark.hollow`) run hollow pods (kvfence_devcluster/hollow.py), which report the same
pools and take the same pushes but serve nothing."""

import json
import sys
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import openai
import pytest

from helpers import fake_pool_server
from helpers.operators import start_operator
from helpers.tiny_infd import (
    KIND,
    NAME,
    USER_KEY,
    api_keys_secret,
    backends_of,
    canary_tries,
    check_first_rollout,
    complete,
    condition,
    early_release_in_decode_of,
    engine_pods,
    engine_urls,
    events,
    gates,
    hollow_canary_flags,
    infd,
    manifest,
    revision_of_manifest,
    routed_to,
    router_client,
    selector_for,
    update_spec,
    wait_condition,
    wait_promoted,
    with_max_num_seqs,
)
from helpers.waits import READY_S
from kvfence_devcluster.fixtures import start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import KV_POOL_GATE, LABEL_REVISION
from kvfence_operator.revision import revision_of


@pytest.mark.hollow
def test_refuse_keeps_pods_with_a_too_small_pool_unready_and_serves_nothing(cluster, operator):
    small = str(32 * 16 * 768)  # 512 tokens, contextLength 1024
    created = cluster.create(manifest(engine={"kvCacheMemory": small}))
    revision = revision_of(InferenceDeploymentSpec.model_validate(created["spec"]))
    refused = wait_condition(cluster, "PoolSufficient", "False", reason="PoolTooSmall")
    message = condition(refused, "PoolSufficient")["message"]
    assert f"{NAME}-{revision}-decode-" in message or f"{NAME}-{revision}-prefill-" in message
    assert "KV pool of 512 tokens, smaller than contextLength 1024" in message
    wait_condition(cluster, "Ready", "False", reason="PoolInsufficient")
    assert condition(infd(cluster), "Degraded")["status"] == "True"

    pods = engine_pods(cluster, revision)
    assert len(pods) == 2
    for pod in pods:
        gate = cluster.pod_condition(pod, KV_POOL_GATE)
        assert gate is not None and gate["status"] == "False"
        ready = cluster.pod_condition(pod, "Ready")
        assert ready is not None and ready["status"] == "False"
    assert cluster.get("Service", NAME) is None, "no stable Service: no traffic"
    assert cluster.list("Job", "default", selector_for(revision, Role.CANARY)) == []
    assert infd(cluster)["status"]["revision"].get("current") is None


def test_lower_context_serves_the_smallest_pool_and_refuses_below_min_context(cluster, operator):
    pool = str(40 * 16 * 768)  # 640 tokens
    created = cluster.create(
        manifest(
            engine={"kvCacheMemory": pool},
            poolPolicy="LowerContext",
            minContextLength=256,
            canary={"enabled": False},
        )
    )
    revision = revision_of(InferenceDeploymentSpec.model_validate(created["spec"]))
    ready = wait_condition(cluster, "Ready", "True", timeout=READY_S)
    assert ready["status"]["contextLength"] == {"requested": 1024, "effective": 640}
    assert "lowered from 1024" in condition(ready, "PoolSufficient")["message"]

    client = router_client(cluster, revision)
    cluster.wait_for(
        lambda: (client.models.list().data[0].model_extra or {})["max_model_len"],
        "the router to serve the lowered context",
        until=lambda n: n == 640,
    )
    served = client.completions.create(
        model="tiny-random", prompt=[7] * 600, max_tokens=2, temperature=0
    )
    assert served.usage is not None and served.usage.prompt_tokens == 600
    with pytest.raises(openai.BadRequestError) as over:
        client.completions.create(model="tiny-random", prompt=[7] * 700, max_tokens=2)
    assert over.value.code == "context_length_exceeded"

    # minContextLength above every pool: not a new revision, but every pod is refused.
    update_spec(cluster, {"minContextLength": 1024})
    refused = wait_condition(cluster, "PoolSufficient", "False", reason="PoolTooSmall")
    assert "below minContextLength 1024" in condition(refused, "PoolSufficient")["message"]
    assert infd(cluster)["status"]["revision"]["current"] == revision
    cluster.wait_for(
        lambda: gates(cluster, revision),
        "every pod's kv-pool gate to close",
        until=lambda found: found == ["False", "False"],
    )


@pytest.mark.slow
def test_serving_after_the_canary_then_a_rollout_that_stops_on_a_bad_canary(tmp_path):
    """The real canary: it passes the first revision, which then serves; a revision whose
    decode releases pages early (a real --unsafe-fault, let past the pool gate) fails its
    canary on a finding, and the first revision keeps serving."""
    bad = with_max_num_seqs("16")
    bad_revision = revision_of_manifest(bad)
    options = KubeletOptions(amend_argv=early_release_in_decode_of(bad_revision))
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        cluster.create(api_keys_secret())
        # the bad revision's decode reports its fault: let it past the pool gate, so that
        # this test sees the canary catch it
        operator = start_operator(cluster, env={"KVFENCE_ALLOW_UNSAFE": "1"})

        first = cluster.create(manifest())
        r1 = revision_of_manifest(first)
        check_first_rollout(cluster, first, r1)
        assert complete(cluster, r1, tokens=4) == 4

        update_spec(cluster, bad["spec"])
        failed = wait_condition(cluster, "CanaryPassed", "False", timeout=READY_S)
        status = failed["status"]
        assert status["revision"] == {"current": r1, "candidate": bad_revision}
        assert status["canary"]["result"] == "Failed"
        message = condition(failed, "CanaryPassed")["message"]
        assert bad_revision in message and "FAIL" in message, message
        assert "hollow" not in message  # the real canary's finding
        (bad_job,) = cluster.list("Job", "default", selector_for(bad_revision, Role.CANARY))
        assert condition(bad_job, "Failed")["reason"] == "PodFailurePolicy", "a finding: no retry"
        assert [t.get("exitCode") for t in canary_tries(cluster, bad_revision)] == [1]
        degraded = wait_condition(cluster, "Degraded", "True", reason="CanaryFailed")
        # r1 serves: Ready (a Deployment's Available), naming the candidate's verdict
        assert condition(degraded, "Ready")["status"] == "True"
        assert f"revision {r1} serves" in condition(degraded, "Ready")["message"]
        assert (
            f"revision {bad_revision} failed its canary" in condition(degraded, "Ready")["message"]
        )
        assert cluster.require("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r1
        assert complete(cluster, r1, prompt="still here") == 2
        operator.stop()
        assert not cluster.problems()


@pytest.mark.slow
@pytest.mark.hollow
def test_a_rollout_survives_an_operator_crash_and_the_old_revision_goes_after_its_drain(
    tmp_path,
):
    """A new revision comes up beside the serving one; the operator is killed while the
    candidate's canary runs, and a fresh operator promotes it and retires the old revision."""
    release = tmp_path / "let-the-canary-finish"
    rollout = {"retireAfterSeconds": 3}  # the drain itself: test_a_stream_in_flight_...
    second = with_max_num_seqs("32", rollout=rollout)
    r2 = revision_of_manifest(second)
    held = hollow_canary_flags(r2, lambda: ["--hollow-wait-for", str(release)])
    options = KubeletOptions(hollow=True, amend_argv=held)
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        cluster.create(api_keys_secret())
        operator = start_operator(cluster)
        first = cluster.create(manifest(rollout=rollout))
        r1 = revision_of_manifest(first)
        check_first_rollout(cluster, first, r1)

        update_spec(cluster, second["spec"])
        cluster.wait_for(
            lambda: engine_pods(cluster, r2),
            "the new revision's pods beside the old ones",
            until=lambda pods: len(pods) == 2 and len(engine_pods(cluster, r1)) == 2,
        )
        cluster.wait_for(
            lambda: cluster.list("Pod", "default", selector_for(r2, Role.CANARY)),
            "the candidate's canary to run",
            until=lambda pods: [p["status"].get("phase") for p in pods] == ["Running"],
        )
        operator.kill()
        assert infd(cluster)["status"]["revision"] == {"current": r1, "candidate": r2}
        release.touch()
        operator = start_operator(cluster)
        wait_promoted(cluster, r2, "promotion of the new revision after the restart")
        cluster.wait_for(
            lambda: cluster.list("Deployment", "default", {LABEL_REVISION: r1}),
            "the old revision's Deployments to be removed after its drain",
            timeout=60,
            until=lambda found: found == [],
        )
        for role in ("prefill", "decode", "router"):
            found = cluster.list(
                "Deployment", "default", {LABEL_REVISION: r2, "kvfence.dev/role": role}
            )
            assert len(found) == 1, f"{role}: {[d['metadata']['name'] for d in found]}"
        assert len(cluster.list("Job", "default", selector_for(r2, Role.CANARY))) == 1
        assert routed_to(cluster, r2) == engine_urls(cluster, r2)
        operator.stop()
        assert not cluster.problems()


@pytest.mark.slow
@pytest.mark.hollow
def test_a_canary_that_cannot_run_is_retried_then_rerun_on_request_and_scaling_works_meanwhile(
    tmp_path,
):
    """A candidate's canary that cannot run (exit 2) is tried 4 times, then it is
    CouldNotRun: Degraded, not promoted, the serving revision keeps serving. Meanwhile the
    serving revision scales with the spec. Once the cause is gone, a new value of
    kvfence.dev/rerun-canary runs it again and the candidate is promoted."""
    cannot_run = tmp_path / "canary-cannot-run"
    second = with_max_num_seqs("32")
    r2 = revision_of_manifest(second)
    flaky = hollow_canary_flags(
        r2, lambda: ["--hollow-verdict", "cannot-run" if cannot_run.exists() else "pass"]
    )
    with start_cluster(
        tmp_path / "cluster", kubelet=KubeletOptions(hollow=True, amend_argv=flaky)
    ) as cluster:
        cluster.create(api_keys_secret())
        operator = start_operator(cluster)
        first = cluster.create(manifest())
        r1 = revision_of_manifest(first)
        check_first_rollout(cluster, first, r1)

        cannot_run.touch()
        update_spec(cluster, second["spec"])
        stuck = wait_condition(
            cluster, "Degraded", "True", timeout=READY_S, reason="CanaryCouldNotRun"
        )
        status = stuck["status"]
        assert status["revision"] == {"current": r1, "candidate": r2}
        assert status["canary"]["result"] == "CouldNotRun"
        message = condition(stuck, "Degraded")["message"]
        assert "could not run (BackoffLimitExceeded): no verdict in 4 tries" in message, message
        assert "last try: kvfence canary ERROR" in message, message
        assert condition(stuck, "CanaryPassed")["status"] == "Unknown"
        assert condition(stuck, "Ready")["reason"] == "Serving"  # r1 serves
        assert f"revision {r2} could not run its canary" in condition(stuck, "Ready")["message"]
        (job,) = cluster.list("Job", "default", selector_for(r2, Role.CANARY))
        failed = condition(job, "Failed")
        assert (failed["status"], failed["reason"]) == ("True", "BackoffLimitExceeded")
        assert [t.get("exitCode") for t in canary_tries(cluster, r2)] == [2, 2, 2, 2]
        assert events(cluster, "CanaryCouldNotRun")
        assert cluster.require("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r1
        assert routed_to(cluster, r1) == engine_urls(cluster, r1)

        # Scaling is not a new revision, and reaches the revision that serves.
        update_spec(cluster, {"prefill": {"replicas": 2}})
        (prefill,) = cluster.list("Deployment", "default", selector_for(r1, Role.PREFILL))
        cluster.wait_for(
            lambda: cluster.require("Deployment", prefill["metadata"]["name"]),
            "the serving revision's prefill to scale to 2 ready pods",
            timeout=120,
            until=lambda d: d["spec"]["replicas"] == 2 and d["status"].get("readyReplicas") == 2,
        )
        cluster.wait_for(
            lambda: routed_to(cluster, r1)["prefill"],
            "the serving revision's router to route to both prefill pods",
            until=lambda urls: len(urls) == 2 and urls == engine_urls(cluster, r1)["prefill"],
        )
        assert infd(cluster)["status"]["revision"] == {"current": r1, "candidate": r2}

        # The cause removed, a new annotation value runs the candidate's canary again.
        cannot_run.unlink()
        rerun = {"metadata": {"annotations": {"kvfence.dev/rerun-canary": "after-the-fix"}}}
        cluster.patch(*KIND[:1], NAME, rerun, api_version=KIND[1])
        promoted = wait_promoted(cluster, r2, "promotion of the candidate after its canary ran")
        assert promoted["status"]["canary"]["result"] == "Passed"
        assert events(cluster, "CanaryRerun")
        (again,) = cluster.list("Job", "default", selector_for(r2, Role.CANARY))
        assert again["metadata"]["uid"] != job["metadata"]["uid"]
        assert again["metadata"]["annotations"]["kvfence.dev/rerun-canary"] == "after-the-fix"
        assert again["status"].get("succeeded") == 1

        # With nothing rolling out, a new value re-runs nothing: r2's passed canary stays.
        reruns = len(events(cluster, "CanaryRerun"))
        rerun = {"metadata": {"annotations": {"kvfence.dev/rerun-canary": "once-more"}}}
        cluster.patch(*KIND[:1], NAME, rerun, api_version=KIND[1])
        operator.wait_passes(3, NAME)  # passes that saw the new value
        (kept,) = cluster.list("Job", "default", selector_for(r2, Role.CANARY))
        assert kept["metadata"]["uid"] == again["metadata"]["uid"]
        assert len(events(cluster, "CanaryRerun")) == reruns
        assert infd(cluster)["status"]["canary"]["result"] == "Passed"
        operator.stop()
        assert not cluster.problems()


@pytest.mark.hollow
def test_a_pod_with_a_garbage_or_unreachable_pool_report_is_not_sufficient(tmp_path):
    fake = fake_pool_server.__file__

    def impostors(pod: dict[str, Any], argv: list[str]) -> list[str]:
        role = (pod["metadata"].get("labels") or {}).get("kvfence.dev/role")
        if role not in ("prefill", "decode"):
            return argv
        port = argv[argv.index("--port") + 1]
        return [sys.executable, str(fake), "garbage" if role == "decode" else "drop", port]

    with start_cluster(
        tmp_path / "cluster", kubelet=KubeletOptions(hollow=True, amend_argv=impostors)
    ) as cluster:
        cluster.create(api_keys_secret())
        operator = start_operator(cluster)
        cluster.create(manifest(canary={"enabled": False}))
        obj = cluster.wait_for(
            lambda: infd(cluster),
            "both impostor pods to be judged",
            timeout=60,
            until=lambda o: (
                "malformed /v1/kvpool" in condition(o, "PoolSufficient").get("message", "")
                and "unreachable" in condition(o, "PoolSufficient").get("message", "")
            ),
        )
        pool = condition(obj, "PoolSufficient")
        assert pool["status"] == "False" and pool["reason"] == "PoolUnknown"
        assert "malformed /v1/kvpool (role: " in pool["message"]  # which field was wrong
        for role in ("prefill", "decode"):
            assert f"pod {NAME}-" in pool["message"] and f"-{role}-" in pool["message"]
        assert condition(obj, "Ready")["status"] == "False"
        assert cluster.get("Service", NAME) is None
        for pod in cluster.list("Pod", "default", {"app.kubernetes.io/instance": NAME}):
            if pod["metadata"]["labels"]["kvfence.dev/role"] in ("prefill", "decode"):
                assert cluster.require_condition(pod, KV_POOL_GATE)["status"] == "False"
        operator.stop()


@pytest.mark.hollow
def test_objects_that_are_not_ours_stay_untouched_and_the_stable_service_follows_the_spec(
    cluster, operator
):
    """A user's Service named like the deployment is a NameConflict, not a takeover; a pod
    labelled like an engine but not the revision's never joins the backends; a Service port
    or annotation change in the spec reaches the stable Service and status.endpoint."""
    theirs = cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": NAME, "labels": {"team": "web"}},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "web", "port": 8080}]},
        }
    )
    created = cluster.create(manifest(canary={"enabled": False}))
    revision = revision_of(InferenceDeploymentSpec.model_validate(created["spec"]))
    prefill = cluster.wait_for(
        lambda: cluster.get("Deployment", f"{NAME}-{revision}-prefill"), "the prefill Deployment"
    )
    # A real engine with the revision's prefill labels and pod spec, that no Deployment owns.
    template = prefill["spec"]["template"]
    cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "impostor", "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
    )
    served = cluster.wait_for(
        lambda: infd(cluster),
        "the revision to be promoted",
        timeout=READY_S,
        until=lambda o: (
            (o.get("status") or {}).get("revision", {}).get("current") == revision
            and condition(o, "Ready").get("reason") in ("Serving", "NameConflict")
        ),
    )
    impostor = cluster.wait_for(
        lambda: cluster.get("Pod", "impostor"),
        "the impostor engine to run",
        timeout=120,
        until=lambda p: (cluster.pod_condition(p, "ContainersReady") or {}).get("status") == "True",
    )
    operator.wait_passes(4, NAME)  # with the impostor running

    backends = json.loads(
        cluster.get("ConfigMap", f"{NAME}-{revision}-router")["data"]["backends.json"]
    )
    (ours,) = [p for p in engine_pods(cluster, revision) if p["metadata"]["name"] != "impostor"
               and p["metadata"]["labels"]["kvfence.dev/role"] == "prefill"]  # fmt: skip
    assert backends["prefill"] == [cluster.pod_url(ours)], "only the Deployment's pod"
    assert cluster.pod_url(impostor) not in backends["prefill"] + backends["decode"]
    assert cluster.pod_condition(cluster.get("Pod", "impostor"), KV_POOL_GATE) is None
    assert "impostor" not in [p["pod"] for p in infd(cluster)["status"]["pools"]]

    ready = condition(served, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict"), ready
    assert f"Service {NAME} exists and is not controlled by this" in ready["message"]
    assert "no controller" in ready["message"]
    assert (condition(served, "Degraded")["status"], condition(served, "Degraded")["reason"]) == (
        "True",
        "NameConflict",
    )
    assert "endpoint" not in served["status"] or served["status"]["endpoint"] is None
    untouched = cluster.get("Service", NAME)
    for key in ("labels", "ownerReferences", "annotations", "resourceVersion"):
        assert untouched["metadata"].get(key) == theirs["metadata"].get(key), key
    assert untouched["spec"] == theirs["spec"]
    assert [e for e in cluster.list("Event") if e.get("reason") == "NameConflict"]

    # The user's Service goes: the operator's takes the name and the deployment is Ready.
    cluster.delete("Service", NAME)
    ready_obj = wait_condition(cluster, "Ready", "True", timeout=60, reason="Serving")
    assert ready_obj["status"]["endpoint"] == f"http://{NAME}.default.svc:8000"
    service = cluster.wait_for(lambda: cluster.get("Service", NAME), "the operator's Service")
    assert [o["uid"] for o in service["metadata"]["ownerReferences"]] == [
        created["metadata"]["uid"]
    ]
    assert service["spec"]["selector"][LABEL_REVISION] == revision

    # spec.router.service changes reach the Service in place (no new revision).
    router = {"apiKeysSecret": f"{NAME}-keys",
              "service": {"port": 9000, "annotations": {"example.com/owner": "ml"}}}  # fmt: skip
    cluster.patch(*KIND[:1], NAME, {"spec": {"router": router}}, api_version=KIND[1])
    service = cluster.wait_for(
        lambda: cluster.get("Service", NAME),
        "the Service to take port 9000 and the annotation",
        until=lambda s: (
            [p["port"] for p in s["spec"]["ports"]] == [9000]
            and (s["metadata"].get("annotations") or {}).get("example.com/owner") == "ml"
        ),
    )
    assert service["spec"]["selector"][LABEL_REVISION] == revision
    cluster.wait_for(
        lambda: infd(cluster)["status"].get("endpoint"),
        "status.endpoint to say port 9000",
        until=lambda endpoint: endpoint == f"http://{NAME}.default.svc:9000",
    )
    assert infd(cluster)["status"]["revision"]["current"] == revision
    router["service"] = {"port": 9000, "annotations": None}  # merge patch: drop the key
    cluster.patch(*KIND[:1], NAME, {"spec": {"router": router}}, api_version=KIND[1])
    cluster.wait_for(
        lambda: cluster.get("Service", NAME)["metadata"].get("annotations") or {},
        "the annotation dropped from the spec to leave the Service",
        until=lambda annotations: "example.com/owner" not in annotations,
    )


@pytest.mark.slow
@pytest.mark.hollow
def test_the_serving_revision_keeps_serving_through_a_refused_candidate_and_a_lost_status(
    cluster, operator
):
    """contextLength 1024 -> 2048 with pools of 1536 tokens: the candidate is refused, and the
    serving revision is still judged against the spec it was created from (gates True, its
    router's backends file unchanged, its router routing to its engines). Then status is lost
    mid-rollout (a backup restore without it): the serving revision is read back from the
    operator's own seal on the stable Service (kvfence.dev/serving, an HMAC only it can make;
    never from the selector) and nothing of it is removed."""
    first = cluster.create(manifest())
    r1 = revision_of(InferenceDeploymentSpec.model_validate(first["spec"]))
    check_first_rollout(cluster, first, r1)
    served = backends_of(cluster, r1)
    assert served["contextLength"] == 1024 and served["prefill"] and served["decode"]
    routes = {role: sorted(served[role]) for role in ("prefill", "decode")}
    assert routed_to(cluster, r1) == routes

    wider = manifest(contextLength=2048)
    r2 = revision_of(InferenceDeploymentSpec.model_validate(wider["spec"]))
    update_spec(cluster, {"contextLength": 2048})
    refused = cluster.wait_for(
        lambda: infd(cluster),
        "the candidate's pods to be refused",
        timeout=120,
        until=lambda o: (
            condition(o, "PoolSufficient").get("reason") == "PoolTooSmall"
            and f"{NAME}-{r2}-" in condition(o, "PoolSufficient").get("message", "")
            and len(engine_pods(cluster, r2)) == 2
        ),
    )
    assert "smaller than contextLength 2048" in condition(refused, "PoolSufficient")["message"]
    assert refused["status"]["revision"] == {"current": r1, "candidate": r2}
    operator.wait_passes(3, NAME)  # that judged both revisions
    assert gates(cluster, r1) == ["True", "True"]
    assert backends_of(cluster, r1) == served
    assert cluster.require("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r1
    assert routed_to(cluster, r1) == routes
    for pod in engine_pods(cluster, r2):
        assert cluster.require_condition(pod, KV_POOL_GATE)["status"] == "False"
    assert cluster.list("Job", "default", selector_for(r2, Role.CANARY)) == []

    lost = infd(cluster)
    cluster.replace({**lost, "status": {}}, subresource="status")
    recovered = cluster.wait_for(
        lambda: infd(cluster),
        "the operator to write status again",
        until=lambda o: (o.get("status") or {}).get("revision") is not None,
    )
    assert recovered["status"]["revision"] == {"current": r1, "candidate": r2}
    operator.wait_passes(3, NAME)  # after the restore
    assert len(cluster.list("Deployment", "default", {LABEL_REVISION: r1})) == 3
    assert cluster.require("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r1
    assert backends_of(cluster, r1) == served
    assert routed_to(cluster, r1) == routes
    assert infd(cluster)["status"]["revision"] == {"current": r1, "candidate": r2}


# ---- promotion that drains ------------------------------------------------------------------

RETIRE_AFTER = 20
# tiny-random KV: 256 pages of 16 tokens hold 4096 tokens
ROOMY = str(256 * 16 * 768)
LONG_STREAM = 3000  # ~30 s of tokens here: it outlives the promotion and the retire delay


@pytest.mark.slow
def test_a_stream_in_flight_at_promotion_completes_and_the_old_revision_goes_after_its_delay(
    tmp_path,
):
    """A stream through the stable Service to r1 goes on while r2 is promoted: r1 keeps its
    pods (and PodDisruptionBudgets) for rollout.retireAfterSeconds after the switch, then its
    pods drain (preStop, then --drain-seconds) and everything of r1 is gone."""

    def spec(max_num_seqs: str) -> dict[str, Any]:
        return manifest(
            engine={
                "kvCacheMemory": ROOMY,
                "extraArgs": ["--threads", "1", "--max-num-seqs", max_num_seqs],
            },
            contextLength=4096,
            canary={"enabled": False},
            rollout={"retireAfterSeconds": RETIRE_AFTER, "terminationGracePeriodSeconds": 90},
        )

    # the kubelet honours the pods' whole grace period (60 s in this test)
    with start_cluster(tmp_path / "cluster", kubelet=KubeletOptions(grace_cap=90)) as cluster:
        cluster.create(api_keys_secret())
        operator = start_operator(cluster)
        first = cluster.create(spec("16"))
        r1 = revision_of(InferenceDeploymentSpec.model_validate(first["spec"]))
        wait_condition(cluster, "Ready", "True", timeout=READY_S)
        uid = first["metadata"]["uid"]
        budgets = cluster.list("PodDisruptionBudget", "default", {LABEL_REVISION: r1})
        assert sorted(b["metadata"]["labels"]["kvfence.dev/role"] for b in budgets) == [
            "decode",
            "prefill",
            "router",
        ]
        for budget in budgets:
            assert budget["spec"]["maxUnavailable"] == 1
            assert [o["uid"] for o in budget["metadata"]["ownerReferences"]] == [uid]

        stable = cluster.require("Service", NAME)["spec"]["clusterIP"]
        client = openai.OpenAI(
            base_url=f"http://{stable}:8000/v1", api_key=USER_KEY, max_retries=0, timeout=120
        )
        stream = client.completions.create(
            model="tiny-random", prompt="go on", max_tokens=LONG_STREAM, temperature=0, stream=True
        )
        chunks = iter(stream)
        received = [next(chunks)]  # to r1: the only revision there is

        second = spec("32")
        r2 = revision_of(InferenceDeploymentSpec.model_validate(second["spec"]))
        update_spec(cluster, second["spec"])
        promoted = cluster.wait_for(
            lambda: infd(cluster)["status"]["revision"],
            "the promotion of r2",
            timeout=READY_S,
            until=lambda revision: revision.get("current") == r2,
        )
        # switched, and r1 drains: kept whole, in status as retiring
        assert cluster.require("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r2
        assert [r["revision"] for r in promoted["retiring"]] == [r1]
        assert len(cluster.list("Deployment", "default", {LABEL_REVISION: r1})) == 3
        assert len(cluster.list("PodDisruptionBudget", "default", {LABEL_REVISION: r1})) == 3
        switched = datetime.fromisoformat(promoted["retiring"][0]["since"])

        cluster.wait_for(
            lambda: cluster.list("Deployment", "default", {LABEL_REVISION: r1}),
            "r1's Deployments to be retired",
            timeout=RETIRE_AFTER + 60,
            until=lambda found: found == [],
        )
        assert datetime.now(UTC) - switched >= timedelta(seconds=RETIRE_AFTER)
        for kind in ("PodDisruptionBudget", "Service", "ConfigMap", "NetworkPolicy"):
            cluster.wait_for(  # the same pass deletes them, just after the Deployments
                partial(cluster.list, kind, "default", {LABEL_REVISION: r1}),
                f"r1's {kind} objects to be retired",
                timeout=10,
                until=lambda found: found == [],
            )
        assert len(cluster.list("PodDisruptionBudget", "default", {LABEL_REVISION: r2})) == 3
        assert infd(cluster)["status"]["revision"].get("retiring") is None

        # the stream that began on r1 ends whole, after r1 was retired: its pods drained it
        received += list(chunks)
        tokens = [c for c in received if c.choices and c.choices[0].text]
        assert received[-1].choices[0].finish_reason == "length"
        assert len(tokens) == LONG_STREAM
        # and new requests reach r2
        answer = client.completions.create(model="tiny-random", prompt="hi", max_tokens=2)
        assert answer.usage is not None and answer.usage.completion_tokens == 2
        operator.stop()
        assert not cluster.problems()
