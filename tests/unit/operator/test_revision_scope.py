"""Each revision is judged by the spec it was created from (recorded on its router ConfigMap),
and the revision that serves is found from the cluster when status is lost."""

import pytest

from helpers.builders import instance_for, sample_spec
from helpers.crd_admission import load_sample
from helpers.rollout import observation
from kvfence_operator.crd.types import InferenceDeployment, InferenceDeploymentSpec, RevisionStatus
from kvfence_operator.decisions.rollout import plan_rollout, selected_revision, serving_revision
from kvfence_operator.meta import LABEL_REVISION, owner_reference
from kvfence_operator.revision import judged_spec, revision_of, spec_record


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
    # a revision an older operator created has no record: the object's spec, as before
    assert judged_spec(old, new, wider, None) == wider
    assert judged_spec(old, new, wider, "{not json") == wider


def test_a_lost_status_mid_rollout_keeps_the_revision_the_stable_service_selects():
    """Status wiped while r2 is a candidate that is not ready: r1, which the Service selects,
    is current again, keeps serving and is kept; r2 stays the candidate."""
    recovered = serving_revision(None, "r1")
    assert recovered == RevisionStatus(current="r1", candidate=None)
    plan = plan_rollout("r2", recovered, None, {"r2": observation("r2", ready=0)}, True)
    assert plan.serve == "r1"
    assert set(plan.keep) == {"r1", "r2"}
    assert plan.revision == RevisionStatus(current="r1", candidate="r2")


def test_the_stable_service_wins_over_a_stale_status():
    """A crash between switching the Service to r2 and writing status: r2 serves."""
    stale = RevisionStatus(current="r1", candidate="r2")
    assert serving_revision(stale, "r2") == RevisionStatus(current="r2", candidate=None)
    plan = plan_rollout("r2", serving_revision(stale, "r2"), None, {}, True)
    assert plan.serve == "r2" and plan.keep == ("r2",)
    # an older status restored from a backup, the Service on r1: r1 serves, r2 stays candidate
    restored = RevisionStatus(current="r0", candidate="r2")
    assert serving_revision(restored, "r1") == RevisionStatus(current="r1", candidate="r2")


@pytest.mark.parametrize(
    "status",
    [None, RevisionStatus(current="r1", candidate="r2"), RevisionStatus(candidate="r1")],
)
def test_without_a_stable_service_status_is_the_record(status):
    assert serving_revision(status, None) == status
    if status is not None and status.current == "r1":
        assert serving_revision(status, "r1") == status


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
