"""Names, labels and owner references shared by every child object."""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfence_operator.crd.types import (
    API_GROUP,
    API_VERSION,
    KIND,
    NAME_MAX_LENGTH,
    NAME_PATTERN,
    Role,
)

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_REVISION = f"{API_GROUP}/revision"
LABEL_ROLE = f"{API_GROUP}/role"
APP_NAME = "kvfence"
MANAGER = "kvfence-operator"
# The Helm chart labels the operator's pods with this; the NetworkPolicies let them probe pools.
OPERATOR_POD_LABELS = {LABEL_NAME: MANAGER}
KV_POOL_GATE = f"{API_GROUP}/kv-pool"
# On the stable Service: the annotation keys that came from spec.router.service.annotations,
# so that a key removed from the spec is removed from the Service, and no one else's is.
MANAGED_ANNOTATIONS = f"{API_GROUP}/managed-annotations"
# On the stable Service: which revision the operator made it serve, sealed with an HMAC only
# the operator can make (builders/secret.py::serving_seal). Status is the record of what
# serves; this seal is where a lost status is recovered from (decisions/rollout.py).
ANNOTATION_SERVING = f"{API_GROUP}/serving"
# On a revision's router ConfigMap: the spec that revision is judged by (revision.spec_record).
ANNOTATION_SPEC = f"{API_GROUP}/spec"
# On a revision's Deployments: what they were built as, sealed (decisions/declaration.py), so
# an operator upgrade whose builders differ rolls no kept revision.
ANNOTATION_DECLARED = f"{API_GROUP}/declared"
# On the InferenceDeployment, and recorded on its canary Job: a new value asks for a new run of
# a candidate's canary (decisions/canary.py).
ANNOTATION_RERUN_CANARY = f"{API_GROUP}/rerun-canary"
# On an engine pod a scale-down removes: when it was taken out of the routers' backends
# (decisions/draining.py); with the lowest deletion cost, so its ReplicaSet removes it first.
ANNOTATION_DRAINING = f"{API_GROUP}/draining-since"
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

HTTP_PORT = 8000
TRANSFER_PORT = 8001


@dataclass(frozen=True, slots=True)
class Instance:
    """The InferenceDeployment being built for: what every child's name and owner need."""

    name: str
    namespace: str
    uid: str

    def __post_init__(self) -> None:
        if len(self.name) > NAME_MAX_LENGTH or not re.match(NAME_PATTERN, self.name):
            raise ValueError(
                f"InferenceDeployment name {self.name!r} must be a DNS label of at most "
                f"{NAME_MAX_LENGTH} characters starting with a letter (children are named "
                "<name>-<revision>-<role> and must stay within 63)"
            )
        if not self.namespace or not self.uid:
            raise ValueError(f"{self.name}: namespace and uid are required for owner references")


def child_name(instance: Instance, revision: str, component: Role | str) -> str:
    return f"{instance.name}-{revision}-{component}"


def service_url(instance: Instance, service: str, port: int = HTTP_PORT) -> str:
    return f"http://{service}.{instance.namespace}.svc:{port}"


def selector(
    instance: Instance, revision: str | None = None, role: Role | None = None
) -> dict[str, str]:
    """Labels that identify pods; Deployment selectors and Services use exactly these."""
    labels = {LABEL_NAME: APP_NAME, LABEL_INSTANCE: instance.name}
    if revision is not None:
        labels[LABEL_REVISION] = revision
    if role is not None:
        labels[LABEL_ROLE] = str(role)
    return labels


def labels(
    instance: Instance, revision: str | None = None, role: Role | None = None
) -> dict[str, str]:
    return {**selector(instance, revision, role), LABEL_MANAGED_BY: MANAGER}


def owner_reference(instance: Instance) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": instance.name,
        "uid": instance.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(instance: Instance, name: str, object_labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": instance.namespace,
        "labels": object_labels,
        "ownerReferences": [owner_reference(instance)],
    }


def controller_reference(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ownerReference with controller: true, if any (Kubernetes allows at most one)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((dict(ref) for ref in refs if ref.get("controller")), None)


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Is `obj` controlled by the object with this UID? Labels and names prove nothing: anyone
    can set them, only the controller reference says whose an object is."""
    ref = controller_reference(obj)
    return ref is not None and ref.get("uid") == uid


def owner_description(obj: Mapping[str, Any]) -> str:
    """Who controls `obj`, for a message: `InferenceDeployment other (uid 1234)`, or `no
    controller` when nothing does (an object someone created by hand)."""
    ref = controller_reference(obj)
    if ref is None:
        return "no controller"
    return f"{ref.get('kind', '?')} {ref.get('name', '?')} (uid {ref.get('uid', '?')})"
