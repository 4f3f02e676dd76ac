"""The operator end to end: `kvfence operator` (kopf) against the test cluster, whose kubelet
runs every pod as a real engine, router or canary process with builtin:tiny-random."""

import base64
import json
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import openai
import pytest

from helpers import fake_pool_server
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import KV_POOL_GATE, LABEL_REVISION, Instance, selector
from kvfence_operator.revision import revision_of

NAME = "tiny"
USER_KEY = "sk-user-a-0123456789"
KIND = ("InferenceDeployment", "kvfence.dev/v1alpha1")
# tiny-random KV costs 768 bytes per token: 96 pages of 16 tokens hold 1536 tokens.
ENOUGH = str(96 * 16 * 768)


def manifest(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "engine": {"kvCacheMemory": ENOUGH, "extraArgs": ["--threads", "1"]},
            "contextLength": 1024,
            "prefill": {"resources": {"requests": {"cpu": "1"}}},
            "decode": {"resources": {"requests": {"cpu": "1"}}},
            "router": {"apiKeysSecret": f"{NAME}-keys"},
            "canary": {"timeoutSeconds": 120},
            **spec,
        },
    }


def api_keys_secret() -> dict[str, Any]:
    keys = base64.b64encode(f"{USER_KEY} team-a\n".encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{NAME}-keys"},
        "data": {"api-keys": keys},
    }


def infd(cluster: Cluster) -> dict[str, Any]:
    obj = cluster.get(*KIND[:1], NAME, api_version=KIND[1])
    assert obj is not None
    return obj


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind]
    return found[0] if found else {}


def wait_condition(
    cluster: Cluster, kind: str, status: str, timeout: float = 120.0, reason: str | None = None
) -> dict[str, Any]:
    def holds(obj: dict[str, Any]) -> bool:
        c = condition(obj, kind)
        return c.get("status") == status and (reason is None or c.get("reason") == reason)

    return cluster.wait_for(
        lambda: infd(cluster), f"{kind}={status} ({reason or 'any reason'})", timeout, until=holds
    )


def engine_pods(cluster: Cluster, revision: str) -> list[dict[str, Any]]:
    instance_labels = {"app.kubernetes.io/instance": NAME, LABEL_REVISION: revision}
    return [
        p
        for p in cluster.list("Pod", "default", instance_labels)
        if p["metadata"]["labels"].get("kvfence.dev/role") in ("prefill", "decode")
    ]


def router_client(cluster: Cluster, revision: str) -> openai.OpenAI:
    (pod,) = cluster.list(
        "Pod", "default", {"app.kubernetes.io/instance": NAME, LABEL_REVISION: revision,
                           "kvfence.dev/role": "router"}
    )  # fmt: skip
    return openai.OpenAI(
        base_url=cluster.pod_url(pod) + "/v1", api_key=USER_KEY, max_retries=0, timeout=60
    )


@pytest.fixture
def operator(cluster: Cluster) -> Iterator[Any]:
    cluster.create(api_keys_secret())
    process = cluster.start_operator(
        ["--standalone", "--namespace", "default"], env={"KVFENCE_RECONCILE_INTERVAL": "1"}
    )
    yield process
    process.stop()


def early_release_in_decode_of(revision: str) -> Callable[[dict[str, Any], list[str]], list[str]]:
    """A kubelet `amend_argv`: that revision's decode pods run with --unsafe-fault
    early-release (which no InferenceDeployment can ask for), so its canary must fail."""

    def amend(pod: dict[str, Any], argv: list[str]) -> list[str]:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(LABEL_REVISION) == revision and labels.get("kvfence.dev/role") == "decode":
            return [*argv, "--unsafe-fault", "early-release"]
        return argv

    return amend


def check_first_rollout(cluster: Cluster, created: dict[str, Any], revision: str) -> None:
    """Children owned by the InferenceDeployment, gates open, canary passed, stable Service on
    the revision, status complete, and the router serving."""
    ready = wait_condition(cluster, "Ready", "True", timeout=240)
    status = ready["status"]

    assert status["revision"]["current"] == revision
    assert status["revision"].get("candidate") is None
    assert status["canary"]["result"] == "Passed"
    assert status["contextLength"] == {"requested": 1024, "effective": 1024}
    assert status["minPoolTokens"] == 1536
    assert {p["role"] for p in status["pools"]} == {"prefill", "decode"}
    assert status["observedGeneration"] == created["metadata"]["generation"]
    for kind in ("Ready", "PoolSufficient", "CanaryPassed"):
        assert condition(ready, kind)["status"] == "True", kind
    assert condition(ready, "Degraded")["status"] == "False"
    assert condition(ready, "Progressing")["status"] == "False"

    uid = created["metadata"]["uid"]
    for kind in ("Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy", "Job"):
        children = cluster.list(kind, "default", {"app.kubernetes.io/instance": NAME})
        assert children, kind
        for child in children:
            owners = child["metadata"].get("ownerReferences") or []
            assert [o["uid"] for o in owners] == [uid], f"{kind} {child['metadata']['name']}"

    for pod in engine_pods(cluster, revision):
        gate = cluster.pod_condition(pod, KV_POOL_GATE)
        assert gate is not None and gate["status"] == "True", pod["metadata"]["name"]

    (job,) = cluster.list("Job", "default", selector_for(revision, Role.CANARY))
    assert job["status"].get("succeeded") == 1

    stable = cluster.get("Service", NAME)
    assert stable is not None
    assert stable["spec"]["selector"][LABEL_REVISION] == revision

    answer = router_client(cluster, revision).completions.create(
        model="tiny-random", prompt="hello", max_tokens=4, temperature=0
    )
    assert answer.usage.completion_tokens == 4


def wait_promoted(cluster: Cluster, revision: str, what: str) -> dict[str, Any]:
    """Wait until `revision` serves and is Ready: its canary passed, the stable Service
    selects it."""
    promoted = cluster.wait_for(
        lambda: infd(cluster),
        what,
        timeout=240,
        until=lambda o: (
            o["status"]["revision"].get("current") == revision
            and condition(o, "Ready").get("status") == "True"
        ),
    )
    assert promoted["status"]["canary"]["revision"] == revision
    assert cluster.get("Service", NAME)["spec"]["selector"][LABEL_REVISION] == revision
    return promoted


def selector_for(revision: str, role: Role) -> dict[str, str]:
    return selector(Instance(NAME, "default", "uid-unused-in-selectors"), revision, role)


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
    ready = wait_condition(cluster, "Ready", "True", timeout=180)
    assert ready["status"]["contextLength"] == {"requested": 1024, "effective": 640}
    assert "lowered from 1024" in condition(ready, "PoolSufficient")["message"]

    client = router_client(cluster, revision)
    cluster.wait_for(
        lambda: client.models.list().data[0].model_extra["max_model_len"],
        "the router to serve the lowered context",
        until=lambda n: n == 640,
    )
    served = client.completions.create(
        model="tiny-random", prompt=[7] * 600, max_tokens=2, temperature=0
    )
    assert served.usage.prompt_tokens == 600
    with pytest.raises(openai.BadRequestError) as over:
        client.completions.create(model="tiny-random", prompt=[7] * 700, max_tokens=2)
    assert over.value.code == "context_length_exceeded"

    # minContextLength above every pool: not a new revision, but every pod is refused.
    cluster.patch(*KIND[:1], NAME, {"spec": {"minContextLength": 1024}}, api_version=KIND[1])
    refused = wait_condition(cluster, "PoolSufficient", "False", reason="PoolTooSmall")
    assert "below minContextLength 1024" in condition(refused, "PoolSufficient")["message"]
    assert infd(cluster)["status"]["revision"]["current"] == revision
    cluster.wait_for(
        lambda: [
            cluster.pod_condition(p, KV_POOL_GATE)["status"] for p in engine_pods(cluster, revision)
        ],
        "every pod's kv-pool gate to close",
        until=lambda gates: gates == ["False", "False"],
    )


@pytest.mark.slow
def test_serving_after_the_canary_then_rollouts_that_survive_a_crash_and_stop_on_a_bad_canary(
    tmp_path,
):
    bad = manifest(
        engine={"kvCacheMemory": ENOUGH, "extraArgs": ["--threads", "1", "--max-num-seqs", "16"]}
    )
    bad_revision = revision_of(InferenceDeploymentSpec.model_validate(bad["spec"]))
    options = KubeletOptions(amend_argv=early_release_in_decode_of(bad_revision))
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        cluster.create(api_keys_secret())
        # the bad revision's decode reports its fault: let it past the pool gate, so that
        # this test sees the canary catch it
        env = {"KVFENCE_RECONCILE_INTERVAL": "1", "KVFENCE_ALLOW_UNSAFE": "1"}
        args = ["--standalone", "--namespace", "default"]
        operator = cluster.start_operator(args, env=env)

        first = cluster.create(manifest())
        r1 = revision_of(InferenceDeploymentSpec.model_validate(first["spec"]))
        check_first_rollout(cluster, first, r1)

        # A new revision: it comes up beside r1, the operator crashes mid-rollout and resumes.
        second = manifest(
            engine={
                "kvCacheMemory": ENOUGH,
                "extraArgs": ["--threads", "1", "--max-num-seqs", "32"],
            }
        )
        r2 = revision_of(InferenceDeploymentSpec.model_validate(second["spec"]))
        cluster.patch(*KIND[:1], NAME, {"spec": second["spec"]}, api_version=KIND[1])
        cluster.wait_for(
            lambda: engine_pods(cluster, r2),
            "the new revision's pods beside the old ones",
            until=lambda pods: len(pods) == 2 and len(engine_pods(cluster, r1)) == 2,
        )
        cluster.wait_for(
            lambda: infd(cluster)["status"]["revision"],
            "status to record the rollout",
            until=lambda revision: revision == {"current": r1, "candidate": r2},
        )
        operator.kill()
        operator = cluster.start_operator(args, env=env)
        wait_promoted(cluster, r2, "promotion of the new revision after the restart")
        cluster.wait_for(
            lambda: cluster.list("Deployment", "default", {LABEL_REVISION: r1}),
            "the old revision's Deployments to be removed",
            timeout=90,  # after the default 30 s drain (spec.rollout.retireAfterSeconds)
            until=lambda found: found == [],
        )
        for role in ("prefill", "decode", "router"):
            found = cluster.list(
                "Deployment", "default", {LABEL_REVISION: r2, "kvfence.dev/role": role}
            )
            assert len(found) == 1, f"{role}: {[d['metadata']['name'] for d in found]}"
        assert len(cluster.list("Job", "default", selector_for(r2, Role.CANARY))) == 1

        # A revision whose decode releases pages early: its canary fails, r2 keeps serving.
        cluster.patch(*KIND[:1], NAME, {"spec": bad["spec"]}, api_version=KIND[1])
        failed = wait_condition(cluster, "CanaryPassed", "False", timeout=240)
        status = failed["status"]
        assert status["revision"] == {"current": r2, "candidate": bad_revision}
        assert status["canary"]["result"] == "Failed"
        message = condition(failed, "CanaryPassed")["message"]
        assert bad_revision in message and "FAIL" in message, message
        (bad_job,) = cluster.list("Job", "default", selector_for(bad_revision, Role.CANARY))
        assert condition(bad_job, "Failed")["reason"] == "PodFailurePolicy", "a finding: no retry"
        assert [t.get("exitCode") for t in canary_tries(cluster, bad_revision)] == [1]
        degraded = wait_condition(cluster, "Degraded", "True", reason="CanaryFailed")
        assert condition(degraded, "Ready")["status"] == "False"
        assert f"revision {r2} keeps serving" in condition(degraded, "Ready")["message"]
        assert cluster.get("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r2
        answer = router_client(cluster, r2).completions.create(
            model="tiny-random", prompt="still here", max_tokens=2, temperature=0
        )
        assert answer.usage.completion_tokens == 2
        operator.stop()
        assert not cluster.problems()


def canary_tries(cluster: Cluster, revision: str) -> list[dict[str, Any]]:
    """The terminated states of the revision's canary pods."""
    pods = cluster.list("Pod", "default", selector_for(revision, Role.CANARY))
    return [(p["status"]["containerStatuses"][0]["state"].get("terminated") or {}) for p in pods]


@pytest.mark.slow
def test_a_canary_that_cannot_run_is_retried_then_rerun_on_request_and_scaling_works_meanwhile(
    tmp_path,
):
    """A candidate's canary that cannot run (exit 2: here a flag its argparse refuses) is
    tried 4 times, then it is CouldNotRun: Degraded, not promoted, the serving revision keeps
    serving. Meanwhile the serving revision scales with the spec. Once the cause is gone, a
    new value of kvfence.dev/rerun-canary runs it again and the candidate is promoted."""
    cannot_run = tmp_path / "canary-cannot-run"

    def flaky_canary(pod: dict[str, Any], argv: list[str]) -> list[str]:
        role = (pod["metadata"].get("labels") or {}).get("kvfence.dev/role")
        return [*argv, "--rounds", "0"] if role == "canary" and cannot_run.exists() else argv

    options = KubeletOptions(amend_argv=flaky_canary)
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        cluster.create(api_keys_secret())
        args = ["--standalone", "--namespace", "default"]
        operator = cluster.start_operator(args, env={"KVFENCE_RECONCILE_INTERVAL": "1"})
        first = cluster.create(manifest())
        r1 = revision_of(InferenceDeploymentSpec.model_validate(first["spec"]))
        check_first_rollout(cluster, first, r1)

        cannot_run.touch()
        second = manifest(
            engine={
                "kvCacheMemory": ENOUGH,
                "extraArgs": ["--threads", "1", "--max-num-seqs", "32"],
            }
        )
        r2 = revision_of(InferenceDeploymentSpec.model_validate(second["spec"]))
        cluster.patch(*KIND[:1], NAME, {"spec": second["spec"]}, api_version=KIND[1])
        stuck = wait_condition(cluster, "Degraded", "True", timeout=240, reason="CanaryCouldNotRun")
        status = stuck["status"]
        assert status["revision"] == {"current": r1, "candidate": r2}
        assert status["canary"]["result"] == "CouldNotRun"
        message = condition(stuck, "Degraded")["message"]
        assert "could not run (BackoffLimitExceeded): no verdict in 4 tries" in message, message
        assert condition(stuck, "CanaryPassed")["status"] == "Unknown"
        assert condition(stuck, "Ready")["reason"] == "CanaryCouldNotRun"
        assert f"revision {r1} keeps serving" in condition(stuck, "Ready")["message"]
        (job,) = cluster.list("Job", "default", selector_for(r2, Role.CANARY))
        failed = condition(job, "Failed")
        assert (failed["status"], failed["reason"]) == ("True", "BackoffLimitExceeded")
        assert [t.get("exitCode") for t in canary_tries(cluster, r2)] == [2, 2, 2, 2]
        assert [e for e in cluster.list("Event") if e.get("reason") == "CanaryCouldNotRun"]
        assert cluster.get("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r1
        answer = router_client(cluster, r1).completions.create(
            model="tiny-random", prompt="still here", max_tokens=2, temperature=0
        )
        assert answer.usage.completion_tokens == 2

        # Scaling is not a new revision, and reaches the revision that serves.
        cluster.patch(*KIND[:1], NAME, {"spec": {"prefill": {"replicas": 2}}},
                      api_version=KIND[1])  # fmt: skip
        (prefill,) = cluster.list("Deployment", "default", selector_for(r1, Role.PREFILL))
        cluster.wait_for(
            lambda: cluster.get("Deployment", prefill["metadata"]["name"]),
            "the serving revision's prefill to scale to 2 ready pods",
            timeout=120,
            until=lambda d: d["spec"]["replicas"] == 2 and d["status"].get("readyReplicas") == 2,
        )
        assert infd(cluster)["status"]["revision"] == {"current": r1, "candidate": r2}

        # The cause removed, a new annotation value runs the candidate's canary again.
        cannot_run.unlink()
        rerun = {"metadata": {"annotations": {"kvfence.dev/rerun-canary": "after-the-fix"}}}
        cluster.patch(*KIND[:1], NAME, rerun, api_version=KIND[1])
        promoted = cluster.wait_for(
            lambda: infd(cluster),
            "promotion of the candidate after its canary ran again",
            timeout=240,
            until=lambda o: (
                o["status"]["revision"].get("current") == r2
                and condition(o, "Ready").get("status") == "True"
            ),
        )
        assert promoted["status"]["canary"]["result"] == "Passed"
        assert [e for e in cluster.list("Event") if e.get("reason") == "CanaryRerun"]
        (again,) = cluster.list("Job", "default", selector_for(r2, Role.CANARY))
        assert again["metadata"]["uid"] != job["metadata"]["uid"]
        assert again["metadata"]["annotations"]["kvfence.dev/rerun-canary"] == "after-the-fix"
        assert again["status"].get("succeeded") == 1
        assert cluster.get("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r2

        # With nothing rolling out, a new value re-runs nothing: r2's passed canary stays.
        reruns = len([e for e in cluster.list("Event") if e.get("reason") == "CanaryRerun"])
        rerun = {"metadata": {"annotations": {"kvfence.dev/rerun-canary": "once-more"}}}
        cluster.patch(*KIND[:1], NAME, rerun, api_version=KIND[1])
        time.sleep(3)  # a few passes at a 1 s interval
        (kept,) = cluster.list("Job", "default", selector_for(r2, Role.CANARY))
        assert kept["metadata"]["uid"] == again["metadata"]["uid"]
        assert len([e for e in cluster.list("Event") if e.get("reason") == "CanaryRerun"]) == reruns
        assert infd(cluster)["status"]["canary"]["result"] == "Passed"
        operator.stop()
        assert not cluster.problems()


def test_a_pod_with_a_garbage_or_unreachable_pool_report_is_not_sufficient(tmp_path):
    fake = fake_pool_server.__file__

    def impostors(pod: dict[str, Any], argv: list[str]) -> list[str]:
        role = (pod["metadata"].get("labels") or {}).get("kvfence.dev/role")
        if role not in ("prefill", "decode"):
            return argv
        port = argv[argv.index("--port") + 1]
        return [sys.executable, str(fake), "garbage" if role == "decode" else "drop", port]

    with start_cluster(
        tmp_path / "cluster", kubelet=KubeletOptions(amend_argv=impostors)
    ) as cluster:
        cluster.create(api_keys_secret())
        operator = cluster.start_operator(
            ["--standalone", "--namespace", "default"], env={"KVFENCE_RECONCILE_INTERVAL": "1"}
        )
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
                assert cluster.pod_condition(pod, KV_POOL_GATE)["status"] == "False"
        operator.stop()


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
        timeout=240,
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
    time.sleep(4)  # four reconcile passes with the impostor running

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


def backends_of(cluster: Cluster, revision: str) -> dict[str, Any]:
    configmap = cluster.get("ConfigMap", f"{NAME}-{revision}-router")
    assert configmap is not None
    return json.loads(configmap["data"]["backends.json"])


@pytest.mark.slow
def test_the_serving_revision_keeps_serving_through_a_refused_candidate_and_a_lost_status(
    cluster, operator
):
    """contextLength 1024 -> 2048 with pools of 1536 tokens: the candidate is refused, and the
    serving revision is still judged against the spec it was created from (gates True, its
    router's backends file unchanged, its router answering). Then status is lost mid-rollout
    (a backup restore without it): the serving revision is read back from the stable Service
    and nothing of it is removed."""
    first = cluster.create(manifest())
    r1 = revision_of(InferenceDeploymentSpec.model_validate(first["spec"]))
    check_first_rollout(cluster, first, r1)
    served = backends_of(cluster, r1)
    assert served["contextLength"] == 1024 and served["prefill"] and served["decode"]

    wider = manifest(contextLength=2048)
    r2 = revision_of(InferenceDeploymentSpec.model_validate(wider["spec"]))
    cluster.patch(*KIND[:1], NAME, {"spec": {"contextLength": 2048}}, api_version=KIND[1])
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
    time.sleep(3)  # a few more passes at a 1 s interval
    for pod in engine_pods(cluster, r1):
        gate = cluster.pod_condition(pod, KV_POOL_GATE)
        assert gate is not None and gate["status"] == "True", (pod["metadata"]["name"], gate)
    assert backends_of(cluster, r1) == served
    assert cluster.get("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r1
    answer = router_client(cluster, r1).completions.create(
        model="tiny-random", prompt="still serving", max_tokens=2, temperature=0
    )
    assert answer.usage.completion_tokens == 2
    for pod in engine_pods(cluster, r2):
        assert cluster.pod_condition(pod, KV_POOL_GATE)["status"] == "False"
    assert cluster.list("Job", "default", selector_for(r2, Role.CANARY)) == []

    lost = infd(cluster)
    cluster.replace({**lost, "status": {}}, subresource="status")
    recovered = cluster.wait_for(
        lambda: infd(cluster),
        "the operator to write status again",
        until=lambda o: (o.get("status") or {}).get("revision") is not None,
    )
    assert recovered["status"]["revision"] == {"current": r1, "candidate": r2}
    time.sleep(3)  # a few more passes
    assert len(cluster.list("Deployment", "default", {LABEL_REVISION: r1})) == 3
    assert cluster.get("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r1
    assert backends_of(cluster, r1) == served
    answer = router_client(cluster, r1).completions.create(
        model="tiny-random", prompt="after the restore", max_tokens=2, temperature=0
    )
    assert answer.usage.completion_tokens == 2
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
        env = {"KVFENCE_RECONCILE_INTERVAL": "1"}
        operator = cluster.start_operator(["--standalone", "--namespace", "default"], env=env)
        first = cluster.create(spec("16"))
        r1 = revision_of(InferenceDeploymentSpec.model_validate(first["spec"]))
        wait_condition(cluster, "Ready", "True", timeout=240)
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

        stable = cluster.get("Service", NAME)["spec"]["clusterIP"]
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
        cluster.patch(*KIND[:1], NAME, {"spec": second["spec"]}, api_version=KIND[1])
        promoted = cluster.wait_for(
            lambda: infd(cluster)["status"]["revision"],
            "the promotion of r2",
            timeout=240,
            until=lambda revision: revision.get("current") == r2,
        )
        # switched, and r1 drains: kept whole, in status as retiring
        assert cluster.get("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r2
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
                lambda kind=kind: cluster.list(kind, "default", {LABEL_REVISION: r1}),
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
        assert answer.usage.completion_tokens == 2
        operator.stop()
        assert not cluster.problems()
