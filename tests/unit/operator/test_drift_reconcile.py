"""One reconcile pass keeps both revisions of a rollout as declared, each from its own spec,
against an in-memory API server that applies merge patches (the real reconcile code)."""

import copy
from typing import Any

from helpers.builders import CREDENTIALS, OPERATOR_NAMESPACE, container, instance_for
from helpers.crd_admission import load_sample
from helpers.gate import COMPLETE, Gate
from helpers.memory_kube import MemoryKube
from helpers.reconciling import never_probed
from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.network_policy import build_router_network_policy
from kvfence_operator.builders.router_deployment import build_stable_service
from kvfence_operator.builders.secret import serving_seal
from kvfence_operator.crd.types import InferenceDeployment, InferenceDeploymentSpec, Role
from kvfence_operator.meta import child_name
from kvfence_operator.reconcile.reconciler import Reconciler
from kvfence_operator.revision import revision_of

INSTANCE = instance_for("full")


def spec_with(**change: Any) -> InferenceDeploymentSpec:
    manifest = load_sample("full")
    manifest["spec"].update(change)
    return InferenceDeployment.model_validate(manifest).spec


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
    # the stable Service as the operator keeps it: serving `old`, with its seal (legacy
    # credentials, read from the Secret: sealed with the revision's token)
    seal = serving_seal(CREDENTIALS.internal_token.encode(), INSTANCE, old)
    kube = MemoryKube(*built, build_stable_service(serving, INSTANCE, old, seal))
    reconciler = Reconciler(kube, OPERATOR_NAMESPACE, read_pool=never_probed)

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
    kube = MemoryKube(*built, theirs)
    reconciler = Reconciler(kube, OPERATOR_NAMESPACE, read_pool=never_probed)
    reconciler.reconcile(body(spec, revision))  # promoted before the name was taken
    policy = ("NetworkPolicy", child_name(INSTANCE, revision, Role.ROUTER))
    opened = build_router_network_policy(INSTANCE, revision, OPERATOR_NAMESPACE, serving=True)
    assert kube.objects[policy]["spec"] == opened["spec"]
    kube.writes.clear()
    reconciler.reconcile(body(spec, revision))
    assert kube.writes == []
    assert kube.objects[policy]["spec"] == opened["spec"]


def test_a_webhook_that_adds_an_env_var_to_every_template_costs_no_patch_per_pass():
    """Issue 26 item 9: each pass PATCHed every Deployment back, and the webhook added its env
    var again (36 PATCHes a minute per object)."""
    gate = Gate()
    create, patch = gate.kube.create_object, gate.kube.patch

    def admitted(obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Deployment":
            obj = copy.deepcopy(obj)
            for each in obj["spec"]["template"]["spec"]["containers"]:
                each.setdefault("env", []).append({"name": "OTEL_SERVICE_NAME", "value": "x"})
        return obj

    def webhooked_create(obj: dict[str, Any]) -> Any:
        return create(admitted(obj))

    def webhooked_patch(*args: Any, **kwargs: Any) -> Any:
        result = patch(*args, **kwargs)
        key = (args[1], args[3])
        if args[1] == "Deployment" and key in gate.kube.objects:
            gate.kube.objects[key] = admitted(gate.kube.objects[key])
        return result

    gate.kube.create_object = webhooked_create  # type: ignore[method-assign,assignment]
    gate.kube.patch = webhooked_patch  # type: ignore[method-assign]
    gate.verdicts[gate.revision] = COMPLETE
    gate.reconcile(6)
    assert gate.condition("Ready")["status"] == "True"
    gate.kube.writes.clear()
    gate.reconcile(5)
    assert not [w for w in gate.kube.writes if w[:2] == ("patch", "Deployment")]
