"""A rollout driven through the real Reconciler against the in-memory API server, with the
cluster's controllers played by hand (issue 26: what gates a promotion): pods Ready, Deployments
counting them, canary Jobs finishing as a test says."""

import copy
from typing import Any

from helpers.memory_kube import MemoryKube
from helpers.reconciling import sufficient
from kvfence_operator.builders.network_policy import build_router_network_policy
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.decisions.rollout import Event
from kvfence_operator.meta import LABEL_REVISION, LABEL_ROLE, Instance, child_name, selector
from kvfence_operator.reconcile.reconciler import Reconciler
from kvfence_operator.revision import revision_of

OPERATOR_NAMESPACE = "kvfence-system"
INSTANCE = Instance("tiny", "default", "uid-infd")
KEYS = {"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "keys", "namespace": "default"}, "data": {}}  # fmt: skip
BASE = {
    "model": {"source": "builtin:tiny-random"},
    "contextLength": 1024,
    "router": {"apiKeysSecret": "keys"},
    # no drain: what a pass retires goes in that pass, so a test sees it at once
    "rollout": {"retireAfterSeconds": 0},
}
FINDING = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
           "message": "Container canary for pod default/x failed with exit code 1"}  # fmt: skip
COMPLETE = {"type": "Complete", "status": "True"}
STARTED_AT = "2026-01-01T00:00:00Z"  # when every pod's container started: before any gate


def spec_dict(**change: Any) -> dict[str, Any]:
    return {**copy.deepcopy(BASE), **change}


class Gate:
    """One InferenceDeployment, its passes and what they said."""

    def __init__(self, credentials_key: bytes | None = b"the credentials key") -> None:
        self.kube = MemoryKube(KEYS)
        self.reconciler = Reconciler(
            self.kube,
            OPERATOR_NAMESPACE,
            read_pool=sufficient,
            push_backends=lambda *_: None,
            credentials_key=credentials_key,
        )
        self.obj: dict[str, Any] = {
            "metadata": {"name": INSTANCE.name, "namespace": INSTANCE.namespace,
                         "uid": INSTANCE.uid, "generation": 1},
            "spec": spec_dict(),
        }  # fmt: skip
        self.events: list[Event] = []
        # what each revision's canary Job ends with once it exists: a Job condition, or None
        # (it keeps running)
        self.verdicts: dict[str, dict[str, Any] | None] = {}

    # ---- the object -----------------------------------------------------------------------

    @property
    def revision(self) -> str:
        return revision_of(InferenceDeploymentSpec.model_validate(self.obj["spec"]))

    @property
    def status(self) -> dict[str, Any]:
        return self.obj.get("status") or {}

    def set_spec(self, **change: Any) -> str:
        self.obj["spec"] = spec_dict(**change)
        self.obj["metadata"]["generation"] += 1
        return self.revision

    def annotate(self, key: str, value: str) -> None:
        self.obj["metadata"].setdefault("annotations", {})[key] = value

    # ---- passes ---------------------------------------------------------------------------

    def reconcile(self, passes: int = 1) -> None:
        """`passes` passes, the controllers playing after each one."""
        for _ in range(passes):
            outcome = self.reconciler.reconcile(copy.deepcopy(self.obj))
            self.obj["status"] = outcome.status.model_dump(
                mode="json", by_alias=True, exclude_none=True
            )
            self.events += outcome.events
            self.play()

    def play(self) -> None:
        """The controllers: one Running pod per Deployment, its readyReplicas counting it; a
        canary Job finishing with its revision's verdict."""
        for (kind, name), obj in list(self.kube.objects.items()):
            labels = obj["metadata"].get("labels") or {}
            if kind == "Deployment":
                pod = f"{name}-0"
                if ("Pod", pod) not in self.kube.objects:
                    role = Role(labels[LABEL_ROLE])
                    self.kube.objects[("Pod", pod)] = ready_pod(
                        pod, labels[LABEL_REVISION], role, obj["metadata"]["uid"]
                    )
                replicas = obj["spec"].get("replicas", 1)
                obj["status"] = {"readyReplicas": replicas, "replicas": replicas}
            if kind == "Job" and not (obj.get("status") or {}).get("conditions"):
                verdict = self.verdicts.get(labels.get(LABEL_REVISION, ""))
                if verdict is not None:
                    obj["status"] = {"conditions": [verdict]}

    # ---- what the cluster holds -----------------------------------------------------------

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.kube.objects.get((kind, name))

    def child(self, kind: str, revision: str, role: Role | str) -> dict[str, Any] | None:
        return self.get(kind, child_name(INSTANCE, revision, role))

    def selected(self) -> str | None:
        service = self.get("Service", INSTANCE.name)
        return ((service or {}).get("spec") or {}).get("selector", {}).get(LABEL_REVISION)

    def routers_open(self, revision: str) -> bool:
        policy = self.child("NetworkPolicy", revision, Role.ROUTER)
        assert policy is not None, f"revision {revision} has no router NetworkPolicy"
        opened = build_router_network_policy(INSTANCE, revision, OPERATOR_NAMESPACE, True)
        closed = build_router_network_policy(INSTANCE, revision, OPERATOR_NAMESPACE, False)
        assert policy["spec"] in (opened["spec"], closed["spec"]), policy["spec"]
        return bool(policy["spec"] == opened["spec"])

    def exists(self, revision: str) -> bool:
        """Whether any Deployment of `revision` is left."""
        return any(self.child("Deployment", revision, role) for role in Role if role != "canary")

    def events_of(self, reason: str) -> list[Event]:
        return [e for e in self.events if e.reason == reason]

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.status.get("conditions", []) if c["type"] == type_)


def ready_pod(name: str, revision: str, role: Role, deployment_uid: str) -> dict[str, Any]:
    container = "router" if role is Role.ROUTER else "engine"  # as the builders name them
    owner = {"kind": "Deployment", "uid": deployment_uid, "controller": True}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"u-{name}",
                     "labels": selector(INSTANCE, revision, role), "ownerReferences": [owner]},
        "spec": {"containers": [{"name": container,
                                 "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [],
                   "containerStatuses": [{"name": container, "restartCount": 0, "ready": True,
                                          "state": {"running": {"startedAt": STARTED_AT}}}]},
    }  # fmt: skip


def serving_then_rolling(gate: Gate, **change: Any) -> tuple[str, str]:
    """r1 promoted and Ready; then a spec change whose candidate r2 has Ready pods and a canary
    Job that keeps running (not promoted)."""
    r1 = gate.revision
    gate.verdicts[r1] = COMPLETE
    gate.reconcile(6)
    assert gate.condition("Ready")["status"] == "True", gate.status
    assert gate.status["revision"] == {"current": r1}
    r2 = gate.set_spec(**(change or {"contextLength": 2048}))
    assert r2 != r1
    gate.reconcile(4)
    assert gate.status["revision"] == {"current": r1, "candidate": r2}, gate.status
    assert gate.child("Job", r2, Role.CANARY) is not None
    return r1, r2
