"""Each revision is judged by the spec it was created from (recorded on its router ConfigMap),
and the revision that serves is status's record, recovered from the operator's own seal on the
stable Service when status is lost (never from the selector)."""

from typing import Any

import pytest

from helpers.builders import instance_for, sample_spec
from helpers.crd_admission import load_sample
from helpers.rollout import observation
from kvfence_operator.builders.router_deployment import build_stable_service
from kvfence_operator.builders.secret import serving_seal
from kvfence_operator.crd.types import InferenceDeployment, InferenceDeploymentSpec, RevisionStatus
from kvfence_operator.decisions.rollout import (
    plan_rollout,
    sealed_revision,
    selected_revision,
    serving_revision,
)
from kvfence_operator.meta import ANNOTATION_SERVING, LABEL_REVISION, owner_reference
from kvfence_operator.revision import judged_spec, recorded_spec, revision_of, spec_record


def _with(change: dict) -> InferenceDeploymentSpec:
    manifest = load_sample("full")
    manifest["spec"].update(change)
    return InferenceDeployment.model_validate(manifest).spec


def test_a_revision_is_judged_by_the_spec_recorded_on_it():
    serving = sample_spec("full")
    wider = _with({"contextLength": serving.context_length * 2})
    record = spec_record(serving)
    old, new = revision_of(serving), revision_of(wider)
    assert judged_spec(old, new, wider, record) == serving
    assert judged_spec(new, new, wider, spec_record(wider)) == wider
    # the desired revision takes in-place changes (minContextLength) from the object's spec
    in_place = _with({"minContextLength": 1024})
    assert judged_spec(old, old, in_place, record) == in_place
    # no record, or one that is not the revision's (issue 26, item 2): judged by no spec,
    # never by the object's, which is the candidate's (before: the object's spec)
    assert judged_spec(old, new, wider, None) is None
    assert judged_spec(old, new, wider, "{not json") is None
    assert judged_spec(old, new, wider, spec_record(wider)) is None
    assert recorded_spec(old, record) == serving
    assert recorded_spec(old, spec_record(wider)) is None


def test_a_lost_status_mid_rollout_keeps_the_revision_the_operators_seal_names():
    """Status wiped while r2 is a candidate that is not ready: r1, which the operator's seal on
    the stable Service names, is current again, keeps serving and is kept; r2 stays the
    candidate."""
    recovered = serving_revision(None, "r1")
    assert recovered == RevisionStatus(current="r1", candidate=None)
    plan = plan_rollout("r2", recovered, None, {"r2": observation("r2", ready=0)}, True)
    assert plan.serve == "r1"
    assert set(plan.keep) == {"r1", "r2"}
    assert plan.revision == RevisionStatus(current="r1", candidate="r2")


def test_status_is_the_record_the_stable_service_never_wins_over_it():
    """Issue 26, item 1. The stable Service selecting (and even sealed for) another revision
    than status says serves does not make it current: status wins, the Service is put back.
    (Before, the selector won, so `kubectl patch svc` promoted a candidate.) A crash between
    the switch and the status write: r2 is promoted again by its own passed canary
    (test_rollout_plan.py::test_a_crash_between_the_switch_and_the_status_write_still_drains_the_old_revision)."""
    stale = RevisionStatus(current="r1", candidate="r2")
    assert serving_revision(stale, "r2") == stale
    restored = RevisionStatus(current="r0", candidate="r2")
    assert serving_revision(restored, "r1") == restored
    # a status that lost only its current revision keeps its candidate
    assert serving_revision(RevisionStatus(candidate="r2"), "r1") == RevisionStatus(
        current="r1", candidate="r2"
    )
    assert serving_revision(RevisionStatus(candidate="r1"), "r1") == RevisionStatus(current="r1")


@pytest.mark.parametrize(
    "status",
    [None, RevisionStatus(current="r1", candidate="r2"), RevisionStatus(candidate="r1")],
)
def test_without_a_seal_status_is_the_record(status):
    assert serving_revision(status, None) == status
    if status is not None and status.current == "r1":
        assert serving_revision(status, "r1") == status


KEY = b"the credentials key"
R1, R2 = "a1b2c3d4e5", "f6a7b8c9d0"  # revisions, as revision_of names them


def _sealed_service(revision: str, selected: str, seal_key: bytes = KEY, **owner: Any) -> dict:
    instance = instance_for("full")
    service = build_stable_service(
        sample_spec("full"), instance, selected, serving_seal(seal_key, instance, revision)
    )
    service["metadata"]["ownerReferences"][0].update(owner)
    return service


def test_only_the_operators_seal_on_its_own_service_names_the_serving_revision():
    instance = instance_for("full")
    key = lambda _revision: KEY  # noqa: E731
    assert sealed_revision(_sealed_service(R1, R1), instance, key) == R1
    # the selector says nothing: the seal names r1 whatever the Service selects
    assert sealed_revision(_sealed_service(R1, R2), instance, key) == R1
    assert sealed_revision(None, instance, key) is None
    assert sealed_revision(_sealed_service(R1, R1, b"another key"), instance, key) is None
    assert sealed_revision(_sealed_service(R1, R1, uid="someone"), instance, key) is None
    assert sealed_revision(_sealed_service(R1, R1, controller=False), instance, key) is None
    assert sealed_revision(_sealed_service(R1, R1), instance, lambda _r: None) is None
    # a seal copied onto another revision's name does not verify
    forged = _sealed_service(R1, R2)
    seal = forged["metadata"]["annotations"][ANNOTATION_SERVING]
    forged["metadata"]["annotations"][ANNOTATION_SERVING] = R2 + seal.removeprefix(R1)
    assert sealed_revision(forged, instance, key) is None
    forged["metadata"]["annotations"][ANNOTATION_SERVING] = R2
    assert sealed_revision(forged, instance, key) is None
    # what is not a revision's name is not looked up at all
    looked_up: list[str] = []
    forged["metadata"]["annotations"][ANNOTATION_SERVING] = "../x:" + seal.partition(":")[2]

    def key_of(revision: str) -> bytes:
        looked_up.append(revision)
        return KEY

    assert sealed_revision(forged, instance, key_of) is None
    assert looked_up == []


def _service(uid: str, revision: str | None, controller: bool = True) -> dict:
    instance = instance_for("full")
    owner = {**owner_reference(instance), "uid": uid, "controller": controller}
    selector = {"app.kubernetes.io/instance": instance.name}
    if revision is not None:
        selector[LABEL_REVISION] = revision
    return {"metadata": {"ownerReferences": [owner]}, "spec": {"selector": selector}}


def test_only_a_stable_service_this_deployment_controls_names_the_serving_revision():
    uid = instance_for("full").uid
    assert selected_revision(_service(uid, "r1"), uid) == "r1"
    assert selected_revision(None, uid) is None
    assert selected_revision(_service("someone-else", "r1"), uid) is None
    assert selected_revision(_service(uid, "r1", controller=False), uid) is None
    assert selected_revision(_service(uid, None), uid) is None
