"""One reconcile pass keeps both revisions of a rollout as declared, each from its own spec,
against an in-memory API server that applies merge patches (the real reconcile code)."""

import copy
import json
from typing import Any

from helpers.builders import CREDENTIALS, OPERATOR_NAMESPACE, container, instance_for
from helpers.crd_admission import load_sample
from kvfence_devcluster.patching import merge_patch
from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.network_policy import build_router_network_policy
from kvfence_operator.builders.router_deployment import build_stable_service
from kvfence_operator.crd.types import InferenceDeployment, InferenceDeploymentSpec, Role
from kvfence_operator.meta import child_name
from kvfence_operator.reconcile import Reconciler
from kvfence_operator.revision import revision_of

INSTANCE = instance_for("full")


class PatchingKube:
    """Objects by (kind, name); create answers False on a taken name; merge patches applied;
    every write recorded."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        self.objects = {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in objects}
        self.writes: list[tuple[str, str, str]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        return copy.deepcopy(self.objects.get((kind, name)))

    def list(self, api_version: str, kind: str, namespace: str, labels: dict[str, str]) -> Any:
        return [
            copy.deepcopy(o)
            for (k, _), o in self.objects.items()
            if k == kind and labels.items() <= (o["metadata"].get("labels") or {}).items()
        ]

    def create(self, obj: dict[str, Any]) -> bool:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        self.writes.append(("create", *key))
        self.objects[key] = {**copy.deepcopy(obj), "metadata": {**obj["metadata"], "uid": key[1]}}
        return True

    def patch(
        self, api_version: str, kind: str, namespace: str, name: str, patch: Any, subresource=""
    ) -> None:
        self.writes.append(("patch", kind, name))
        key = (kind, name)
        self.objects[key] = merge_patch(self.objects[key], json.loads(json.dumps(patch)))

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.writes.append(("delete", kind, name))
        self.objects.pop((kind, name), None)


def spec_with(**change: Any) -> InferenceDeploymentSpec:
    manifest = load_sample("full")
    manifest["spec"].update(change)
    return InferenceDeployment.model_validate(manifest).spec


def never_probed(pod: str, *_: Any) -> Any:
    raise AssertionError(f"{pod} was probed")


def body(spec: InferenceDeploymentSpec, current: str) -> dict[str, Any]:
    return {
        "metadata": {"name": INSTANCE.name, "namespace": INSTANCE.namespace, "uid": INSTANCE.uid},
        "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
        "status": {"revision": {"current": current}},
    }


def test_a_rollout_keeps_the_serving_revision_as_its_own_spec_declares_it():
    serving = spec_with()
    new = spec_with(contextLength=serving.context_length * 2)
    old, candidate = revision_of(serving), revision_of(new)
    assert old != candidate
    built = build_revision_children(
        serving, INSTANCE, old, CREDENTIALS, OPERATOR_NAMESPACE, serving=True
    )
    kube = PatchingKube(*built, build_stable_service(serving, INSTANCE, old))
    reconciler = Reconciler(kube, OPERATOR_NAMESPACE, read_pool=never_probed)  # type: ignore[arg-type]

    reconciler.reconcile(body(new, old))
    old_prefill = ("Deployment", child_name(INSTANCE, old, Role.PREFILL))
    declared = next(c for c in built if (c["kind"], c["metadata"]["name"]) == old_prefill)
    assert kube.objects[old_prefill]["spec"] == declared["spec"], "the new spec reached old pods"
    # no drift patch; the routers' backends files get their first versioned set (router_push)
    assert not [w for w in kube.writes if w[0] == "patch" and w[1] != "ConfigMap"], kube.writes
    new_router_policy = ("NetworkPolicy", child_name(INSTANCE, candidate, Role.ROUTER))
    assert (
        kube.objects[new_router_policy]["spec"]
        == (
            build_router_network_policy(INSTANCE, candidate, OPERATOR_NAMESPACE, serving=False)[
                "spec"
            ]
        )
    )

    # `kubectl set image` on the serving revision mid-rollout: its own spec's image comes back
    container(kube.objects[old_prefill])["image"] = "evil/engine:1"
    kube.writes.clear()
    reconciler.reconcile(body(new, old))
    assert kube.objects[old_prefill]["spec"] == declared["spec"]
    assert kube.writes == [("patch", *old_prefill)]

    # a pass over unchanged children writes nothing
    kube.writes.clear()
    reconciler.reconcile(body(new, old))
    assert kube.writes == []


def test_the_serving_routers_stay_open_without_a_stable_service_of_ours():
    """The stable Service's name taken by someone else's Service (a NameConflict): status
    still says which revision serves, and its routers' policy stays open, written by no pass."""
    spec = spec_with()
    revision = revision_of(spec)
    built = build_revision_children(spec, INSTANCE, revision, CREDENTIALS, OPERATOR_NAMESPACE)
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": INSTANCE.name}}
    kube = PatchingKube(*built, theirs)
    reconciler = Reconciler(kube, OPERATOR_NAMESPACE, read_pool=never_probed)  # type: ignore[arg-type]
    reconciler.reconcile(body(spec, revision))  # promoted before the name was taken
    policy = ("NetworkPolicy", child_name(INSTANCE, revision, Role.ROUTER))
    opened = build_router_network_policy(INSTANCE, revision, OPERATOR_NAMESPACE, serving=True)
    assert kube.objects[policy]["spec"] == opened["spec"]
    kube.writes.clear()
    reconciler.reconcile(body(spec, revision))
    assert kube.writes == []
    assert kube.objects[policy]["spec"] == opened["spec"]
