"""Whose an object is: the decisions behind "never patch, delete or count an object this
InferenceDeployment does not control".

A child is ours only if its controller ownerReference holds the InferenceDeployment's UID;
labels and names prove nothing, since anyone who can create a pod or a Service can set them.
A pod is a revision's only if the revision's Deployment controls it: through a ReplicaSet the
Deployment controls (a real cluster), or directly (the emulated cluster, which has no
ReplicaSets). Pure functions; the reconciler does the reads.
"""

from collections.abc import Callable, Mapping
from typing import Any

from kvfence_operator.decisions.drift import is_subset
from kvfence_operator.meta import (
    ANNOTATION_SERVING,
    MANAGED_ANNOTATIONS,
    controlled_by,
    controller_reference,
)

ReplicaSetLookup = Callable[[str], Mapping[str, Any] | None]


def pod_controlled_by_deployment(
    pod: Mapping[str, Any], deployment: Mapping[str, Any], replicaset: ReplicaSetLookup
) -> bool:
    """Does `deployment` control `pod`? pod -> ReplicaSet -> Deployment, every link by UID;
    or pod -> Deployment where the Deployment controller creates pods itself."""
    uid = deployment["metadata"]["uid"]
    ref = controller_reference(pod)
    if ref is None:
        return False
    if ref.get("kind") == "Deployment":
        return bool(ref.get("uid") == uid)
    if ref.get("kind") != "ReplicaSet" or not ref.get("name"):
        return False
    owner = replicaset(ref["name"])
    return (
        owner is not None
        and owner["metadata"].get("uid") == ref.get("uid")
        and controlled_by(owner, uid)
    )


def stable_service_patch(
    existing: Mapping[str, Any], wanted: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The merge patch that makes the existing stable Service what `wanted` (the builder's
    Service) declares: type, ports, selector (keys someone added are removed; a revision
    someone else wrote is put back), labels, the spec's annotations (keys the spec dropped are
    removed; others' annotations stay) and the operator's serving seal. None when it already
    is."""
    current_meta = existing.get("metadata") or {}
    current_annotations = current_meta.get("annotations") or {}
    wanted_annotations = dict(wanted["metadata"].get("annotations") or {})
    before = {k for k in current_annotations.get(MANAGED_ANNOTATIONS, "").split(",") if k}
    before.add(ANNOTATION_SERVING)  # the operator's own: a seal it no longer makes goes
    dropped = {
        k: None
        for k in before - wanted_annotations.keys()
        if k in current_annotations and k != MANAGED_ANNOTATIONS
    }
    spec = {key: wanted["spec"][key] for key in ("type", "ports", "selector")}
    current_selector = (existing.get("spec") or {}).get("selector") or {}
    extra_selector = {k: None for k in current_selector if k not in spec["selector"]}
    declared = {
        "metadata": {"labels": wanted["metadata"]["labels"], "annotations": wanted_annotations},
        "spec": spec,
    }
    if is_subset(declared, existing) and not dropped and not extra_selector:
        return None
    return {
        "metadata": {
            "labels": wanted["metadata"]["labels"],
            "annotations": {**wanted_annotations, **dropped},
        },
        "spec": {**spec, "selector": {**spec["selector"], **extra_selector}},
    }
