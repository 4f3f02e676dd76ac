"""Children are kept as declared (drift.py), and a candidate's routers are fenced until it
serves (network_policy.build_router_network_policy)."""

import copy
import json
from typing import Any

import pytest

from helpers.builders import (
    CREDENTIALS,
    OPERATOR_NAMESPACE,
    container,
    instance_for,
    sample_spec,
)
from helpers.crd_admission import load_sample
from kvfence_devcluster.defaults import apply_defaults
from kvfence_devcluster.patching import merge_patch
from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.network_policy import build_router_network_policy
from kvfence_operator.crd.types import InferenceDeployment, Role
from kvfence_operator.decisions.drift import declaring_spec, drift_patch, holds
from kvfence_operator.decisions.replicas import with_replicas_of
from kvfence_operator.meta import OPERATOR_POD_LABELS, child_name, selector
from kvfence_operator.revision import revision_of, spec_record

SPEC = sample_spec("full")
INSTANCE = instance_for("full")
REVISION = revision_of(SPEC)
GROUPS = {"Deployment": ("apps", "deployments"), "Service": ("", "services")}


def children(serving: bool = False) -> dict[str, dict[str, Any]]:
    built = build_revision_children(
        SPEC, INSTANCE, REVISION, CREDENTIALS, OPERATOR_NAMESPACE, serving=serving
    )
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in built}


def live(child: dict[str, Any]) -> dict[str, Any]:
    """The child as an API server stores it: defaults filled, identity and status added, and
    what tools add (an annotation, a label)."""
    obj = copy.deepcopy(child)
    group, plural = GROUPS.get(child["kind"], ("", ""))
    apply_defaults(group, plural, obj, creating=True)
    if child["kind"] == "Service" and "clusterIP" not in child["spec"]:
        obj["spec"].update(clusterIP="10.96.0.7", clusterIPs=["10.96.0.7"])
    obj["metadata"].update(uid="u-1", resourceVersion="7", creationTimestamp="2026-11-30T00:00:00Z")
    obj["metadata"].setdefault("annotations", {})["deployment.kubernetes.io/revision"] = "3"
    obj["metadata"]["labels"]["team"] = "ml"
    obj["status"] = {"observedGeneration": 1}
    return obj


def deployment(role: Role = Role.PREFILL) -> dict[str, Any]:
    return children()[f"Deployment/{child_name(INSTANCE, REVISION, role)}"]


def policy(role: Role) -> dict[str, Any]:
    return children()[f"NetworkPolicy/{child_name(INSTANCE, REVISION, role)}"]


def reverted(child: dict[str, Any], edited: dict[str, Any]) -> dict[str, Any]:
    """Apply the drift patch as the API server does; the result must hold the declaration."""
    patch = drift_patch(child, edited)
    assert patch is not None, "the edit was not seen"
    fixed = merge_patch(edited, json.loads(json.dumps(patch)))
    assert drift_patch(child, fixed) is None, "the patch did not put the child back"
    return fixed


@pytest.mark.parametrize("key", sorted(children()))
def test_an_unchanged_child_is_not_written_despite_defaults_and_others_metadata(key):
    child = children()[key]
    assert drift_patch(child, live(child)) is None


def test_set_image_on_a_deployment_is_reverted_with_the_whole_template():
    child = deployment()
    edited = live(child)
    container(edited)["image"] = "evil/engine:latest"
    fixed = reverted(child, edited)
    assert container(fixed)["image"] == container(child)["image"]
    assert fixed["metadata"]["labels"]["team"] == "ml"  # others' labels stay
    assert fixed["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "3"


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: container(d)["env"].append({"name": "KVFENCE_ALLOW_UNSAFE", "value": "1"}),
        lambda d: container(d)["env"][0].update(value="changed"),
        lambda d: container(d)["args"].append("--unsafe-fault"),
        lambda d: d["spec"]["template"]["spec"]["containers"].append(
            {"name": "sidecar", "image": "x"}
        ),
        lambda d: d["spec"]["template"]["spec"]["volumes"].pop(),
        lambda d: d["spec"]["template"]["metadata"]["labels"].pop("kvfence.dev/role"),
        lambda d: d["spec"]["selector"]["matchLabels"].update(extra="1"),
        lambda d: d["spec"].update(replicas=9),
        lambda d: d["metadata"]["labels"].pop("app.kubernetes.io/managed-by"),
    ],
    ids=[
        *("kvfence-env", "env-value", "args", "sidecar", "volume"),
        *("pod-label", "selector", "replicas", "label"),
    ],
)
def test_any_change_to_what_a_deployment_declares_is_reverted(edit):
    child = deployment()
    edited = live(child)
    edit(edited)
    reverted(child, edited)


def webhooked(d: dict[str, Any]) -> None:
    """What a mutating webhook (or another controller) adds beside the operator's entries: an
    env var, a volume and its mount, an image pull secret."""
    pod = d["spec"]["template"]["spec"]
    container(d).setdefault("env", []).insert(0, {"name": "OTEL_SERVICE_NAME", "value": "x"})
    container(d).setdefault("volumeMounts", []).append({"name": "ca", "mountPath": "/etc/ca"})
    pod.setdefault("volumes", []).append({"name": "ca", "configMap": {"name": "ca"}})
    pod.setdefault("imagePullSecrets", []).append({"name": "mirror"})


def test_entries_others_add_beside_the_operators_are_not_drift():
    """A webhook that adds an env var to every pod template made the operator PATCH each
    Deployment every pass (36 a minute per object): another manager's list entries stay, as
    server-side apply keeps them; what the operator declares of each entry is still its own."""
    child = deployment()
    edited = live(child)
    webhooked(edited)
    assert drift_patch(child, edited) is None


def test_a_repair_keeps_what_others_added_beside_it():
    child = deployment()
    edited = live(child)
    webhooked(edited)
    container(edited)["image"] = "evil/engine:latest"
    container(edited)["env"][1]["value"] = "changed"
    fixed = reverted(child, edited)
    assert container(fixed)["image"] == container(child)["image"]
    assert {"name": "OTEL_SERVICE_NAME", "value": "x"} in container(fixed)["env"]
    assert [e for e in container(fixed)["env"] if e["name"] != "OTEL_SERVICE_NAME"] == container(
        child
    )["env"]
    assert {"name": "ca", "mountPath": "/etc/ca"} in container(fixed)["volumeMounts"]
    assert {"name": "ca", "configMap": {"name": "ca"}} in fixed["spec"]["template"]["spec"][
        "volumes"
    ]


def test_replicas_come_from_the_objects_spec_for_every_kept_revision():
    """A revision's Deployments take the object's counts, whatever spec they are declared from;
    nothing else of the revision changes with them."""
    scaled_spec = SPEC.model_copy(update={"decode": SPEC.decode.model_copy(update={"replicas": 5})})
    counted = with_replicas_of(SPEC, scaled_spec)
    assert (counted.prefill.replicas, counted.decode.replicas, counted.router.replicas) == (
        SPEC.prefill.replicas,
        5,
        SPEC.router.replicas,
    )
    assert revision_of(counted) == REVISION  # replica counts are revision-neutral
    built = build_revision_children(
        SPEC, INSTANCE, REVISION, CREDENTIALS, OPERATOR_NAMESPACE, deployments_spec=counted
    )
    scaled = {f"{c['kind']}/{c['metadata']['name']}": c for c in built}
    name = f"Deployment/{child_name(INSTANCE, REVISION, Role.DECODE)}"
    assert scaled[name]["spec"]["replicas"] == 5
    assert scaled[name]["spec"]["template"] == deployment(Role.DECODE)["spec"]["template"]
    assert {k: v for k, v in scaled.items() if k != name} == {
        k: v for k, v in children().items() if k != name
    }


def test_a_service_selector_key_someone_added_is_removed():
    child = children()[f"Service/{child_name(INSTANCE, REVISION, Role.ROUTER)}"]
    edited = live(child)
    edited["spec"]["selector"]["kvfence.dev/revision"] = "other"
    edited["spec"]["selector"]["mine"] = "x"
    fixed = reverted(child, edited)
    assert fixed["spec"]["selector"] == child["spec"]["selector"]
    assert fixed["spec"]["clusterIP"] == edited["spec"]["clusterIP"]  # server-allocated: kept


@pytest.mark.parametrize(
    "edit",
    [
        lambda p: p["spec"].update(ingress=[{}]),  # everyone
        lambda p: p["spec"]["ingress"][0].pop("from"),
        lambda p: p["spec"]["podSelector"]["matchLabels"].update(nothing="selected"),
        lambda p: p["spec"]["podSelector"].update(
            matchExpressions=[{"key": "x", "operator": "Exists"}]
        ),
        lambda p: p["spec"].update(policyTypes=["Egress"]),
    ],
    ids=["open", "no-from", "selector-label", "selector-expression", "policy-types"],
)
@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE, Role.ROUTER])
def test_an_edited_network_policy_is_reverted(edit, role):
    child = policy(role)
    edited = live(child)
    edit(edited)
    assert reverted(child, edited)["spec"] == child["spec"]


def test_a_rule_added_to_the_open_router_policy_is_drift():
    child = build_router_network_policy(INSTANCE, REVISION, OPERATOR_NAMESPACE, serving=True)
    edited = live(child)
    edited["spec"]["ingress"][0]["from"] = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    assert reverted(child, edited)["spec"] == child["spec"]


def test_the_router_configmaps_data_and_spec_record_are_not_declared_here():
    """The reconciler writes them from the pods' pools (_write_backends); only the labels and
    owner are kept here."""
    child = children()[f"ConfigMap/{child_name(INSTANCE, REVISION, Role.ROUTER)}"]
    edited = live(child)
    edited["data"] = {"backends.json": "{}"}
    edited["metadata"]["annotations"]["kvfence.dev/spec"] = "{}"
    assert drift_patch(child, edited) is None
    edited["metadata"]["labels"]["kvfence.dev/revision"] = "other"
    fixed = reverted(child, edited)
    assert fixed["data"] == {"backends.json": "{}"}


def test_owner_references_are_restored_and_others_kept():
    child = deployment()
    edited = live(child)
    other = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "someone"}
    edited["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] = False
    edited["metadata"]["ownerReferences"].append(other)
    fixed = reverted(child, edited)
    assert fixed["metadata"]["ownerReferences"] == [other, *child["metadata"]["ownerReferences"]]
    edited = live(child)
    edited["metadata"]["ownerReferences"].append(other)
    assert drift_patch(child, edited) is None


def test_compare_tolerates_defaults_quantities_empties_and_others_entries_not_list_additions():
    assert holds({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}, "d": 3})
    assert holds({"requests": {"cpu": 1}}, {"requests": {"cpu": "1"}})
    assert holds(
        {"limits": {"cpu": "0.5", "memory": "1Gi"}},
        {"limits": {"cpu": "500m", "memory": "1073741824"}},
    )
    assert not holds({"limits": {"cpu": "1"}}, {"limits": {"cpu": "2"}})
    assert not holds({"port": 8000}, {"port": "8000"})  # only quantities compare as text
    assert holds({"env": [], "x": None, "y": {}}, {})
    assert holds({"y": {}}, {"y": {"defaulted": True}})
    assert not holds({"args": []}, {"args": ["--unsafe-fault"]})
    assert holds({"env": []}, {"env": [{"name": "A"}]})  # others' entries (SHARED_LISTS)
    assert not holds({"env": []}, {"env": [{"name": "KVFENCE_ALLOW_UNSAFE"}]})
    assert not holds({"env": [{"name": "A", "value": "1"}]}, {"env": [{"name": "B"}]})
    assert not holds({"x": None}, {"x": 1})
    assert not holds({"l": [1]}, {"l": [1, 2]})
    assert not holds({"selector": {"a": "1"}}, {"selector": {"a": "1", "b": "2"}})
    assert holds({"selector": {"a": "1"}}, {"selector": {"a": "1", "b": None}})


def _spec_with(change: dict[str, Any]):
    manifest = load_sample("full")
    manifest["spec"].update(change)
    return InferenceDeployment.model_validate(manifest).spec


def test_a_revision_is_declared_from_its_own_spec_never_the_new_one():
    new = _spec_with({"contextLength": SPEC.context_length * 2})
    desired = revision_of(new)
    assert desired != REVISION
    assert declaring_spec(desired, desired, new, None) == new
    assert declaring_spec(REVISION, desired, new, spec_record(SPEC)) == SPEC
    # no record (or one that is not this revision's): nothing to declare it from
    assert declaring_spec(REVISION, desired, new, None) is None
    assert declaring_spec(REVISION, desired, new, "{broken") is None
    assert declaring_spec(REVISION, desired, new, spec_record(new)) is None


def test_candidate_routers_admit_only_their_canary_and_the_operator_until_they_serve():
    closed = build_router_network_policy(INSTANCE, REVISION, OPERATOR_NAMESPACE, serving=False)
    assert closed["metadata"]["name"] == child_name(INSTANCE, REVISION, Role.ROUTER)
    assert closed["spec"]["podSelector"] == {
        "matchLabels": selector(INSTANCE, REVISION, Role.ROUTER)
    }
    assert closed["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = closed["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": selector(INSTANCE, REVISION, Role.CANARY)}},
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}
            },
            "podSelector": {"matchLabels": OPERATOR_POD_LABELS},
        },
    ]
    opened = build_router_network_policy(INSTANCE, REVISION, OPERATOR_NAMESPACE, serving=True)
    assert opened["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    assert opened["metadata"] == closed["metadata"]
    # a revision's children carry the closed one until it serves
    assert children()[f"NetworkPolicy/{closed['metadata']['name']}"] == closed
    assert children(serving=True)[f"NetworkPolicy/{closed['metadata']['name']}"] == opened
