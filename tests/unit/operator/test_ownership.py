"""Whose an object is: controller references by UID, the pod -> ReplicaSet -> Deployment
chain, the stable Service's patch, and the NameConflict status."""

from datetime import UTC, datetime
from typing import Any

from helpers.memory_kube import MemoryKube
from helpers.reconciling import body, never_probed
from helpers.reconciling import tiny_spec as spec
from kvfence_operator.builders.router_deployment import build_stable_service
from kvfence_operator.builders.secret import secret_name
from kvfence_operator.crd.types import InferenceDeploymentStatus
from kvfence_operator.decisions.findings import Conflict
from kvfence_operator.decisions.ownership import (
    pod_controlled_by_deployment,
    stable_service_patch,
)
from kvfence_operator.decisions.status import with_conflicts
from kvfence_operator.meta import Instance, controlled_by, owner_description, selector
from kvfence_operator.reconcile.reconciler import Reconciler
from kvfence_operator.revision import revision_of

INSTANCE = Instance("tiny", "default", "uid-infd")
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def ref(kind: str, name: str, uid: str, controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": kind, "name": name, "uid": uid, "controller": controller}


def obj(kind: str, name: str, uid: str, *owners: dict[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": name, "uid": uid, "ownerReferences": list(owners)}}


DEPLOYMENT = obj("Deployment", "tiny-r1-prefill", "uid-dep")


def test_only_the_controller_reference_with_the_uid_makes_an_object_ours():
    assert controlled_by(
        obj("Service", "tiny", "s", ref("InferenceDeployment", "tiny", "uid-infd")), "uid-infd"
    )
    # same name, other UID: a deleted and recreated InferenceDeployment's leftovers are not ours
    assert not controlled_by(
        obj("Service", "tiny", "s", ref("InferenceDeployment", "tiny", "old")), "uid-infd"
    )
    # an owner that is not the controller does not make it ours
    not_controller = ref("InferenceDeployment", "tiny", "uid-infd", controller=False)
    assert not controlled_by(obj("Service", "tiny", "s", not_controller), "uid-infd")
    assert not controlled_by(obj("Service", "tiny", "s"), "uid-infd")


def test_owner_description_names_the_controller_or_says_there_is_none():
    other = obj("Service", "tiny", "s", ref("InferenceDeployment", "other", "u2"))
    assert owner_description(other) == "InferenceDeployment other (uid u2)"
    assert owner_description(obj("Service", "tiny", "s")) == "no controller"


def test_a_pod_is_the_deployments_through_its_replicaset_or_directly():
    replicaset = obj(
        "ReplicaSet",
        "tiny-r1-prefill-5d8f9",
        "uid-rs",
        ref("Deployment", "tiny-r1-prefill", "uid-dep"),
    )
    lookup = {"tiny-r1-prefill-5d8f9": replicaset}.get
    via_rs = obj("Pod", "p1", "u", ref("ReplicaSet", "tiny-r1-prefill-5d8f9", "uid-rs"))
    assert pod_controlled_by_deployment(via_rs, DEPLOYMENT, lookup)
    direct = obj("Pod", "p2", "u", ref("Deployment", "tiny-r1-prefill", "uid-dep"))
    assert pod_controlled_by_deployment(direct, DEPLOYMENT, lookup)


def test_a_pod_labelled_like_an_engine_by_someone_else_is_not_the_deployments():
    foreign_rs = obj("ReplicaSet", "theirs", "uid-theirs", ref("Deployment", "theirs", "uid-other"))
    recreated = obj(
        "ReplicaSet", "tiny-r1-prefill-5d8f9", "uid-new", ref("Deployment", "x", "uid-dep")
    )
    lookup = {"theirs": foreign_rs, "tiny-r1-prefill-5d8f9": recreated}.get
    cases = {
        "no owner": obj("Pod", "p", "u"),
        "another Deployment": obj("Pod", "p", "u", ref("Deployment", "tiny-r1-prefill", "uid-x")),
        "another Deployment's ReplicaSet": obj(
            "Pod", "p", "u", ref("ReplicaSet", "theirs", "uid-theirs")
        ),
        # the ReplicaSet name now belongs to another object than the one the pod points at
        "a ReplicaSet of that name with another UID": obj(
            "Pod", "p", "u", ref("ReplicaSet", "tiny-r1-prefill-5d8f9", "uid-old")
        ),
        "a ReplicaSet that is gone": obj("Pod", "p", "u", ref("ReplicaSet", "gone", "uid-gone")),
        "owned but not controlled": obj(
            "Pod", "p", "u", ref("Deployment", "tiny-r1-prefill", "uid-dep", controller=False)
        ),
        "controlled by a Job": obj("Pod", "p", "u", ref("Job", "tiny-r1-prefill", "uid-dep")),
    }
    for why, pod in cases.items():
        assert not pod_controlled_by_deployment(pod, DEPLOYMENT, lookup), why


def test_the_stable_service_patch_applies_type_port_annotations_and_selector_from_the_spec():
    old = build_stable_service(spec(annotations={"a": "1", "b": "2"}), INSTANCE, "r1")
    existing = {**old, "spec": {**old["spec"], "clusterIP": "10.0.0.9"}}  # server defaults
    existing["metadata"] = {
        **old["metadata"],
        "annotations": {**old["metadata"]["annotations"], "theirs": "x"},
    }
    assert stable_service_patch(existing, old) is None, "already as declared: no write"

    wanted = build_stable_service(
        spec(type="NodePort", port=9000, annotations={"a": "3"}), INSTANCE, "r2"
    )
    patch = stable_service_patch(existing, wanted)
    assert patch is not None
    assert patch["spec"]["type"] == "NodePort"
    assert patch["spec"]["ports"] == [
        {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert patch["spec"]["selector"]["kvfence.dev/revision"] == "r2"
    annotations = patch["metadata"]["annotations"]
    assert annotations["a"] == "3"
    assert annotations["b"] is None, "a key dropped from the spec is removed"
    assert "theirs" not in annotations, "an annotation the spec never set stays"
    assert annotations["kvfence.dev/managed-annotations"] == "a"


def test_the_stable_service_patch_removes_selector_keys_someone_added():
    wanted = build_stable_service(spec(), INSTANCE, "r1")
    existing = {
        **wanted,
        "spec": {**wanted["spec"], "selector": {**wanted["spec"]["selector"], "x": "y"}},
    }
    patch = stable_service_patch(existing, wanted)
    assert patch is not None and patch["spec"]["selector"]["x"] is None


def test_a_name_conflict_is_ready_false_and_degraded_naming_the_object_and_its_owner():
    status = InferenceDeploymentStatus.model_validate(
        {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Serving",
                    "message": "m",
                    "lastTransitionTime": "2025-01-01T00:00:00Z",
                }
            ]
        }
    )
    conflict = Conflict.of(obj("Service", "tiny", "s", ref("HelmRelease", "web", "u9")))
    out = with_conflicts(status, [conflict], generation=3, now=NOW)
    by_type = {c.type: c for c in out.conditions}
    assert by_type["Ready"].status == "False" and by_type["Ready"].reason == "NameConflict"
    assert by_type["Degraded"].status == "True" and by_type["Degraded"].reason == "NameConflict"
    assert by_type["Stalled"].status == "True"
    assert "Service tiny" in by_type["Ready"].message
    assert "HelmRelease web (uid u9)" in by_type["Ready"].message
    assert with_conflicts(status, [], generation=3, now=NOW) == status


# ---- the reconciler against an in-memory API server --------------------------------------


def test_a_revision_secret_name_someone_else_has_stops_the_revision_before_any_pod():
    revision = revision_of(spec())
    foreign: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret_name(INSTANCE, revision), "uid": "x"},
        "data": {"internal-token": "YXR0YWNrZXI="},
    }
    keys = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys"}, "data": {}}
    kube = MemoryKube(foreign, keys)  # the user's apiKeysSecret exists: only the conflict
    outcome = Reconciler(kube, "kvfence-system", read_pool=never_probed).reconcile(body())
    assert not [w for w in kube.writes if w[1] == "Deployment"], kube.writes
    assert kube.objects[("Secret", foreign["metadata"]["name"])] == foreign
    ready = next(c for c in outcome.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "NameConflict")
    assert f"Secret {foreign['metadata']['name']} exists" in ready.message
    assert [e.reason for e in outcome.events if e.type == "Warning"] == ["NameConflict"]


def test_retirement_never_deletes_an_object_labelled_like_a_child_that_is_not_ours():
    old = "0123456789"
    labelled = {**selector(INSTANCE, old), "kvfence.dev/role": "router"}
    theirs = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "theirs", "labels": labelled},
    }
    stale = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "ours-old",
            "labels": labelled,
            "ownerReferences": [ref("InferenceDeployment", "tiny", "uid-infd")],
        },
    }
    kube = MemoryKube(theirs, stale)
    Reconciler(kube, "kvfence-system", read_pool=never_probed).reconcile(body())
    assert ("ConfigMap", "theirs") in kube.objects
    assert ("delete", "ConfigMap", "ours-old") in kube.writes


def test_a_pass_running_when_its_owner_is_reported_deleted_creates_nothing():
    """The timer's pass in flight when the watch reports the InferenceDeployment DELETED: what
    it would create names a gone owner (GPU pods scheduled only to be collected)."""
    keys = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys"}, "data": {}}
    for deleted, creates in ((False, True), (True, False)):
        kube = MemoryKube(keys)

        def owner_deleted(uid: str, deleted: bool = deleted) -> bool:
            return deleted and uid == "uid-infd"

        Reconciler(
            kube,
            "kvfence-system",
            read_pool=never_probed,
            owner_deleted=owner_deleted,
        ).reconcile(body())
        created = [w for w in kube.writes if w[0] == "create"]
        assert bool(created) is creates, created
