"""Issue 26, end to end: nothing but the candidate's own canary promotes it. Each test starts a
rollout on hollow pods (kvfence_devcluster/hollow.py) with `kvfence operator` on the
devcluster, then does with the real `kubectl` what a user with edit rights might: patch the
stable Service's selector, strip the serving revision's spec record then `kubectl set image`,
replace the candidate's canary Job with a hand-made one, remove a failed canary's Job. Each
leaves the serving revision serving and the candidate unpromoted, with an Event saying why."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers.operators import Operator, start_operator
from helpers.tiny_infd import (
    NAME,
    api_keys_secret,
    condition,
    events,
    hollow_canary_flags,
    infd,
    manifest,
    revision_of_manifest,
    selector_for,
    update_spec,
    wait_condition,
    wait_promoted,
    with_max_num_seqs,
)
from helpers.waits import READY_S
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_operator.builders.canary_job import build_canary_job
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import ANNOTATION_SPEC, LABEL_REVISION, Instance, service_url

pytestmark = [pytest.mark.slow, pytest.mark.hollow]

# no drain: a revision retired is gone at once, so "nothing was retired" is seen in a few passes
NO_DRAIN = {"retireAfterSeconds": 0}
SECOND = with_max_num_seqs("32", rollout=NO_DRAIN)
R2 = revision_of_manifest(SECOND)


def containers_of(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


def serving_then_rolling(cluster: Cluster) -> tuple[Operator, str]:
    """r1 serving, then the spec changed to R2: its pods come up and its canary Job starts."""
    cluster.create(api_keys_secret())
    operator = start_operator(cluster)
    first = cluster.create(manifest(rollout=NO_DRAIN))
    wait_condition(cluster, "Ready", "True", timeout=READY_S)
    update_spec(cluster, SECOND["spec"])
    cluster.wait_for(
        lambda: cluster.list("Pod", "default", selector_for(R2, Role.CANARY)),
        "the candidate's canary to run",
        timeout=READY_S,
        until=lambda pods: any(p["status"].get("phase") == "Running" for p in pods),
    )
    return operator, revision_of_manifest(first)


def held(hold: Path, release: Path) -> KubeletOptions:
    """R2's canary pods wait for `release` (which never comes) while `hold` exists."""
    flags: Callable[[], list[str]] = lambda: (  # noqa: E731
        ["--hollow-wait-for", str(release)] if hold.exists() else []
    )
    return KubeletOptions(hollow=True, amend_argv=hollow_canary_flags(R2, flags))


def still_serving(cluster: Cluster, operator: Operator, r1: str) -> dict[str, Any]:
    """After a few more passes: r1 current and selected, its Deployments all there, R2 still
    the candidate, its routers closed to clients, no promotion of it."""
    operator.wait_passes(3, NAME)
    obj = infd(cluster)
    assert obj["status"]["revision"] == {"current": r1, "candidate": R2}, obj["status"]
    assert cluster.require("Service", NAME)["spec"]["selector"][LABEL_REVISION] == r1
    assert len(cluster.list("Deployment", "default", {LABEL_REVISION: r1})) == 3
    policy = cluster.require("NetworkPolicy", f"{NAME}-{R2}-router")
    assert "from" in policy["spec"]["ingress"][0], "the candidate's routers were opened"
    assert not [e for e in events(cluster, "Promoted") if R2 in e.get("message", "")]
    return obj


def test_a_selector_patched_to_the_candidate_is_put_back_and_promotes_nothing(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    options = held(hold, tmp_path / "never")
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        operator, r1 = serving_then_rolling(cluster)
        patch = {"spec": {"selector": {LABEL_REVISION: R2}}}
        cluster.kubectl("patch", "svc", NAME, "-p", json.dumps(patch))
        (warning,) = cluster.wait_for(
            lambda: events(cluster, "SelectorRepaired"),
            "a Warning that the selector was put back",
            until=bool,
        )
        assert warning["type"] == "Warning"
        assert R2 in warning["message"] and r1 in warning["message"]
        still_serving(cluster, operator, r1)
        operator.stop()
        assert not cluster.problems()


def test_a_stripped_record_is_put_back_and_a_later_set_image_still_reverts(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    options = held(hold, tmp_path / "never")
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        operator, r1 = serving_then_rolling(cluster)
        configmap = f"{NAME}-{r1}-router"
        record = cluster.require("ConfigMap", configmap)["metadata"]["annotations"][ANNOTATION_SPEC]
        cluster.kubectl("annotate", "configmap", configmap, f"{ANNOTATION_SPEC}-")
        cluster.wait_for(
            lambda: cluster.require("ConfigMap", configmap)["metadata"].get("annotations") or {},
            "the serving revision's record to be put back",
            until=lambda annotations: annotations.get(ANNOTATION_SPEC) == record,
        )
        (warning,) = cluster.wait_for(
            lambda: events(cluster, "RecordRepaired"), "a Warning that it was put back", until=bool
        )
        assert warning["type"] == "Warning" and configmap in warning["message"]

        prefill = f"{NAME}-{r1}-prefill"
        image = containers_of(cluster.require("Deployment", prefill))[0]
        cluster.kubectl("set", "image", f"deployment/{prefill}", "engine=evil/engine:1")
        cluster.wait_for(
            lambda: containers_of(cluster.require("Deployment", prefill)),
            "kubectl set image on the serving revision to be reverted",
            until=lambda containers: containers[0]["image"] == image["image"],
        )
        still_serving(cluster, operator, r1)
        operator.stop()
        assert not cluster.problems()


def test_a_hand_made_canary_job_that_passes_is_a_name_conflict_not_a_promotion(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    options = held(hold, tmp_path / "never")
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        operator, r1 = serving_then_rolling(cluster)
        # while no operator runs (so that it cannot start its own in between): the
        # operator's Job deleted, and one of the same name and owner made by hand, whose
        # canary checks the serving revision's routers instead of the candidate's
        operator.stop()
        job = f"{NAME}-{R2}-canary"
        cluster.kubectl("delete", "job", job, "--wait=true")
        obj = infd(cluster)
        spec = InferenceDeploymentSpec.model_validate(obj["spec"])
        forged = build_canary_job(spec, Instance(NAME, "default", obj["metadata"]["uid"]), R2)
        args = forged["spec"]["template"]["spec"]["containers"][0]["args"]
        args[args.index("--target") + 1] = service_url(Instance(NAME, "default", "x"), NAME)
        path = tmp_path / "forged-job.json"
        path.write_text(json.dumps(forged))
        hold.unlink()  # the hand-made Job's canary passes at once
        cluster.kubectl("create", "-f", str(path))
        cluster.wait_for(
            lambda: cluster.require("Job", job),
            "the hand-made Job to complete",
            timeout=120,
            until=lambda j: condition(j, "Complete").get("status") == "True",
        )

        operator = start_operator(cluster)
        conflict = wait_condition(cluster, "Degraded", "True", reason="NameConflict")
        assert job in condition(conflict, "Degraded")["message"]
        (warning,) = cluster.wait_for(
            lambda: [e for e in events(cluster, "NameConflict") if job in e["message"]],
            "a Warning naming the hand-made Job",
            until=bool,
        )
        assert warning["type"] == "Warning"
        status = still_serving(cluster, operator, r1)["status"]
        assert status["canary"]["result"] != "Passed"
        operator.stop()
        assert not cluster.problems()


def test_a_failed_canarys_job_removed_stays_failed_until_a_rerun_is_asked(tmp_path):
    fail = tmp_path / "fail"
    fail.touch()
    verdict: Callable[[], list[str]] = lambda: (  # noqa: E731
        ["--hollow-verdict", "fail" if fail.exists() else "pass"]
    )
    options = KubeletOptions(hollow=True, amend_argv=hollow_canary_flags(R2, verdict))
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        operator, r1 = serving_then_rolling(cluster)
        failed = wait_condition(cluster, "Degraded", "True", timeout=120, reason="CanaryFailed")
        job = cluster.require("Job", f"{NAME}-{R2}-canary")
        assert failed["status"]["canary"]["result"] == "Failed"

        fail.unlink()  # were it run again now, it would pass
        cluster.kubectl("delete", "job", job["metadata"]["name"], "--wait=true")  # a cleanup
        status = still_serving(cluster, operator, r1)["status"]
        assert cluster.list("Job", "default", selector_for(R2, Role.CANARY)) == []
        assert status["canary"]["result"] == "Failed"
        assert status["canary"].get("jobUid") == job["metadata"]["uid"]
        assert condition(infd(cluster), "Degraded")["reason"] == "CanaryFailed"
        (said,) = events(cluster, "CanaryFailed")
        assert said["type"] == "Warning" and f"revision {r1} keeps serving" in said["message"]

        # only the explicit request runs it again
        cluster.kubectl(
            "annotate", "infd", NAME, "kvfence.dev/rerun-canary=after-the-fix", "--overwrite"
        )
        wait_promoted(cluster, R2, "promotion of the candidate after the requested rerun")
        assert events(cluster, "CanaryRerun")
        operator.stop()
        assert not cluster.problems()
