"""Issue 26: nothing but the candidate's own canary promotes it. Each case runs the real
Reconciler against the in-memory API server (helpers/gate.py): a selector edit, a record
removed from the serving revision, a hand-made canary Job, a failed canary's Job removed."""

import json
from typing import Any

import pytest

from helpers.gate import COMPLETE, FINDING, INSTANCE, Gate, serving_then_rolling
from kvfence_operator.builders.canary_job import build_canary_job
from kvfence_operator.cluster.kube import KubeError
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import (
    ANNOTATION_RERUN_CANARY,
    ANNOTATION_SPEC,
    LABEL_REVISION,
    child_name,
)
from kvfence_operator.revision import revision_of

# ---- 1. the Service's selector is not a record -----------------------------------------------


KEYED = pytest.mark.parametrize("key", [b"the credentials key", None], ids=["derived", "legacy"])


@KEYED
def test_a_selector_edited_to_the_candidate_promotes_nothing_and_is_put_back(key):
    gate = Gate(key)
    r1, r2 = serving_then_rolling(gate)
    service = gate.get("Service", INSTANCE.name)
    assert service is not None
    service["spec"]["selector"][LABEL_REVISION] = r2  # kubectl patch svc/tiny
    gate.reconcile()
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert gate.selected() == r1, "the selector edit was not repaired"
    assert gate.routers_open(r1) and not gate.routers_open(r2)
    gate.reconcile(3)
    assert gate.exists(r1), "the serving revision was retired on a selector edit"
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    (warning,) = gate.events_of("SelectorRepaired")
    assert warning.type == "Warning"
    assert r2 in warning.message and r1 in warning.message
    assert not gate.events_of("Promoted")[1:], "the candidate was promoted"


@KEYED
def test_a_lost_status_is_recovered_from_the_operators_own_seal_not_from_the_selector(key):
    """Status wiped mid-rollout: the serving revision comes back from what the operator wrote
    and can verify (its seal on the stable Service), and a selector pointed at the candidate
    alongside does not make the candidate current."""
    gate = Gate(key)
    r1, r2 = serving_then_rolling(gate)
    gate.obj.pop("status")
    gate.reconcile()
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert gate.exists(r1) and gate.selected() == r1

    gate.obj.pop("status")
    service = gate.get("Service", INSTANCE.name)
    assert service is not None
    service["spec"]["selector"][LABEL_REVISION] = r2
    gate.reconcile(2)
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert gate.selected() == r1 and gate.exists(r1) and not gate.routers_open(r2)


# ---- 2. the records the operator relies on are kept as declared -------------------------------


def test_a_record_removed_from_the_serving_revision_is_put_back_and_set_image_still_reverts():
    gate = Gate()
    r1, r2 = serving_then_rolling(gate)
    configmap = gate.child("ConfigMap", r1, Role.ROUTER)
    assert configmap is not None
    record = configmap["metadata"]["annotations"].pop(ANNOTATION_SPEC)
    gate.reconcile()
    restored = gate.child("ConfigMap", r1, Role.ROUTER)
    assert restored is not None
    assert restored["metadata"]["annotations"].get(ANNOTATION_SPEC) == record
    prefill = gate.child("Deployment", r1, Role.PREFILL)
    assert prefill is not None
    image = prefill["spec"]["template"]["spec"]["containers"][0]["image"]
    prefill["spec"]["template"]["spec"]["containers"][0]["image"] = "evil/engine:1"
    gate.reconcile()
    prefill = gate.child("Deployment", r1, Role.PREFILL)
    assert prefill is not None
    assert prefill["spec"]["template"]["spec"]["containers"][0]["image"] == image
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    (warning,) = gate.events_of("RecordRepaired")
    assert warning.type == "Warning" and r1 in warning.message


def test_a_record_that_does_not_hash_to_its_revision_is_refused_and_put_back():
    """The candidate's spec written into the serving revision's record: refused (it is not
    r1's), and r1's own record comes back."""
    gate = Gate()
    r1, r2 = serving_then_rolling(gate)
    configmap = gate.child("ConfigMap", r1, Role.ROUTER)
    candidate = gate.child("ConfigMap", r2, Role.ROUTER)
    assert configmap is not None and candidate is not None
    record = configmap["metadata"]["annotations"][ANNOTATION_SPEC]
    forged = candidate["metadata"]["annotations"][ANNOTATION_SPEC]
    assert revision_of(InferenceDeploymentSpec.model_validate(json.loads(forged))) == r2
    configmap["metadata"]["annotations"][ANNOTATION_SPEC] = forged
    gate.reconcile()
    restored = gate.child("ConfigMap", r1, Role.ROUTER)
    assert restored is not None
    assert restored["metadata"]["annotations"][ANNOTATION_SPEC] == record
    backends = json.loads(restored["data"]["backends.json"])
    assert backends["contextLength"] == 1024, "r1's backends were judged by the candidate's spec"
    (warning,) = gate.events_of("RecordRepaired")
    assert warning.type == "Warning" and configmap["metadata"]["name"] in warning.message


def test_a_revision_with_no_record_of_its_own_is_left_as_it_is_and_said_so():
    """Every copy of r1's record removed: r1 is judged and declared by no spec (the object's
    is the candidate's), its backends are not rewritten, and Degraded says why."""
    gate = Gate()
    r1, r2 = serving_then_rolling(gate)
    configmap = gate.child("ConfigMap", r1, Role.ROUTER)
    assert configmap is not None
    served = configmap["data"]["backends.json"]
    for kind, role in [("ConfigMap", Role.ROUTER)] + [
        ("Deployment", role) for role in (Role.PREFILL, Role.DECODE, Role.ROUTER)
    ]:
        child = gate.child(kind, r1, role)
        assert child is not None
        del child["metadata"]["annotations"][ANNOTATION_SPEC]
    gate.reconcile(2)
    configmap = gate.child("ConfigMap", r1, Role.ROUTER)
    assert configmap is not None
    assert ANNOTATION_SPEC not in configmap["metadata"]["annotations"], "a spec not r1's"
    assert configmap["data"]["backends.json"] == served
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert gate.selected() == r1 and gate.exists(r1)
    degraded = gate.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RevisionRecordRefused")
    assert r1 in degraded["message"]
    assert len(gate.events_of("RevisionRecordRefused")) == 1


# ---- 3. only the Job the operator built has a verdict ----------------------------------------


def hand_made_job(gate: Gate, revision: str) -> dict:
    job = build_canary_job(
        InferenceDeploymentSpec.model_validate(gate.obj["spec"]), INSTANCE, revision
    )
    container = job["spec"]["template"]["spec"]["containers"][0]
    container.update(image="busybox:1", command=["true"], args=[], env=[])
    job["metadata"]["uid"] = "u-hand-made"
    job["status"] = {"conditions": [COMPLETE]}
    return job


def test_a_hand_made_job_with_the_canarys_name_and_owner_is_a_name_conflict_not_a_pass():
    gate = Gate()
    r1 = gate.revision
    gate.verdicts[r1] = COMPLETE
    gate.reconcile(6)
    r2 = gate.set_spec(contextLength=2048)
    gate.reconcile()  # r2's children, no Job yet (its pods are not Ready before this pass)
    name = child_name(INSTANCE, r2, Role.CANARY)
    gate.kube.objects.pop(("Job", name), None)
    gate.kube.objects[("Job", name)] = hand_made_job(gate, r2)
    gate.reconcile(3)
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert gate.selected() == r1 and not gate.routers_open(r2)
    degraded = gate.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "NameConflict")
    assert name in degraded["message"]
    (warning,) = [e for e in gate.events_of("NameConflict") if name in e.message]
    assert warning.type == "Warning"
    assert gate.status["canary"]["result"] != "Passed"
    assert not [e for e in gate.events_of("Promoted") if r2 in e.message]


def test_the_operators_own_job_with_the_servers_defaults_still_counts():
    gate = Gate()
    r1 = gate.revision
    gate.verdicts[r1] = COMPLETE
    gate.reconcile(3)
    job = gate.child("Job", r1, Role.CANARY)
    assert job is not None
    container = job["spec"]["template"]["spec"]["containers"][0]
    container.update(imagePullPolicy="IfNotPresent", terminationMessagePath="/dev/termination-log")
    job["spec"].update(completions=1, parallelism=1, suspend=False)
    job["spec"]["template"]["spec"].update(dnsPolicy="ClusterFirst", schedulerName="default")
    gate.reconcile(3)
    assert gate.status["revision"] == {"current": r1}
    assert gate.condition("Ready")["status"] == "True"


# ---- 4. a verdict is kept when its Job goes ----------------------------------------------------


def failed_candidate() -> tuple[Gate, str, str, dict[str, Any] | None]:
    """r1 serving after its canary passed; r2 the candidate, its canary failed on a finding:
    the gate, both revisions and r2's canary Job."""
    gate = Gate()
    r1 = gate.revision
    gate.verdicts[r1] = COMPLETE
    gate.reconcile(6)
    r2 = gate.set_spec(contextLength=2048)
    gate.verdicts[r2] = FINDING
    gate.reconcile(4)
    return gate, r1, r2, gate.child("Job", r2, Role.CANARY)


def test_a_failed_canary_stays_failed_when_its_job_is_removed_until_a_rerun_is_asked():
    gate, r1, r2, job = failed_candidate()
    assert job is not None
    assert gate.status["canary"]["result"] == "Failed"

    gate.kube.objects.pop(("Job", job["metadata"]["name"]))  # the TTL controller
    gate.verdicts[r2] = COMPLETE  # were it run again, it would pass
    gate.reconcile(3)
    assert gate.child("Job", r2, Role.CANARY) is None, "the failed canary ran again by itself"
    assert gate.status["canary"]["result"] == "Failed"
    assert gate.status["canary"].get("jobUid") == job["metadata"]["uid"]
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert gate.condition("Degraded")["reason"] == "CanaryFailed"

    gate.annotate(ANNOTATION_RERUN_CANARY, "2026-11-30")  # the explicit request
    gate.reconcile(4)
    assert gate.child("Job", r2, Role.CANARY) is not None
    assert gate.status["revision"] == {"current": r2}
    assert gate.events_of("CanaryRerun")


def test_a_failed_canarys_job_replaced_by_another_does_not_change_the_verdict():
    gate, r1, r2, job = failed_candidate()
    assert job is not None and gate.status["canary"]["result"] == "Failed"
    # deleted and made again as the operator would make it (same spec), then passing
    again = json.loads(json.dumps(job))
    again["metadata"]["uid"] = "u-again"
    again["status"] = {"conditions": [COMPLETE]}
    gate.kube.objects[("Job", job["metadata"]["name"])] = again
    gate.reconcile(3)
    assert gate.status["canary"]["result"] == "Failed"
    assert gate.status["revision"] == {"current": r1, "candidate": r2}


# ---- 12. a canary Job the API refuses ---------------------------------------------------------

JOB_QUOTA = ('jobs.batch "tiny-x-canary" is forbidden: exceeded quota: compute, requested: '
             "requests.cpu=1, used: requests.cpu=4, limited: requests.cpu=4")  # fmt: skip


def refusing_jobs(gate: Gate, status: int, message: str) -> None:
    """The API server answers `status` to creating any Job from now on (a quota, an
    admission policy)."""
    create = gate.kube.create

    def refusing(obj: dict[str, Any], dry_run: bool = False) -> bool:
        if obj["kind"] == "Job":
            body = json.dumps({"kind": "Status", "status": "Failure", "message": message})
            raise KubeError(status, "POST", "/apis/batch/v1/namespaces/default/jobs", body)
        return create(obj, dry_run)

    gate.kube.create = refusing  # type: ignore[method-assign,assignment]


def test_a_canary_job_the_api_refuses_is_a_condition_with_one_event_and_stalls_at_the_deadline():
    """It said CanaryStarted every pass, and its status Running "starting" forever: a running
    canary is exempt from the progress deadline, so it never stalled."""
    gate = Gate()
    r1 = gate.revision
    gate.verdicts[r1] = COMPLETE
    gate.reconcile(6)
    refusing_jobs(gate, 403, JOB_QUOTA)
    r2 = gate.set_spec(contextLength=2048)
    gate.reconcile(5)
    assert gate.child("Job", r2, Role.CANARY) is None
    assert not [e for e in gate.events_of("CanaryStarted") if r2 in e.message]
    assert len(gate.events_of("CreateFailed")) == 1, gate.events
    canary = gate.status["canary"]
    assert (canary["revision"], canary["result"]) == (r2, "Pending"), canary
    assert JOB_QUOTA in canary["message"]
    assert gate.condition("Degraded")["reason"] == "CreateFailed"
    assert JOB_QUOTA in gate.condition("Progressing")["message"]
    assert gate.condition("Ready")["status"] == "True"  # r1 serves on
    assert gate.condition("Stalled")["status"] == "False"  # a quota can be raised

    # no progress for the deadline: Stalled
    gate.obj["status"]["progress"]["lastProgressTime"] = "2020-01-01T00:00:00Z"
    gate.reconcile()
    assert gate.condition("Stalled")["status"] == "True"
    assert gate.condition("Stalled")["reason"] == "ProgressDeadlineExceeded"
    assert gate.status["revision"] == {"current": r1, "candidate": r2}

    # the quota raised: the canary starts, passes, and promotes
    gate.kube.create = type(gate.kube).create.__get__(gate.kube)  # type: ignore[method-assign]
    gate.verdicts[r2] = COMPLETE
    gate.reconcile(3)
    assert gate.status["revision"] == {"current": r2}
    assert [e for e in gate.events_of("CanaryStarted") if r2 in e.message]


def test_a_canary_job_an_admission_policy_rejects_stalls_at_once():
    gate = Gate()
    message = 'Job.batch "tiny-x-canary" is invalid: spec.template.spec.priorityClassName'
    refusing_jobs(gate, 422, message)
    gate.reconcile(4)
    assert gate.status["canary"]["result"] == "Pending"
    assert gate.condition("Stalled")["reason"] == "CreateRejected"
    assert len(gate.events_of("CreateRejected")) == 1
    assert not gate.events_of("CanaryStarted")
