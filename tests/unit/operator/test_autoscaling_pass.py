"""The autoscaler through the real Reconciler against the in-memory API server (issue 29): the
serving revision's engine Deployments follow the load without a new revision or a canary; a
scale-down takes the pods it removes out of the routers first and lowers the replicas only once
they have finished; a hand edit of the replicas is put back with an Event, except in External
mode, where the replicas are the user's autoscaler's."""

import json
import time
from typing import Any

import pytest

from helpers.gate import COMPLETE, Gate, ready_pod
from kvfence_engine.contracts import LoadReport
from kvfence_operator.builders.router_deployment import BACKENDS_FILE_NAME
from kvfence_operator.crd.types import EventReason, Role
from kvfence_operator.decisions import autoscaling, draining
from kvfence_operator.decisions.autoscaling import PodLoad
from kvfence_operator.meta import ANNOTATION_DRAINING, LABEL_REVISION, LABEL_ROLE, POD_DELETION_COST

SCALING = {
    "prefill": {"minReplicas": 1, "maxReplicas": 4, "signal": "QueuedPromptTokens",
                "target": 100, "scaleUpStabilizationSeconds": 0,
                "scaleDownStabilizationSeconds": 0},
    "decode": {"minReplicas": 1, "maxReplicas": 3, "signal": "RunningSequences", "target": 4,
               "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 0},
}  # fmt: skip


class Loads:
    """The engines' /v1/load: each role's pods report the same figures unless a pod is named."""

    def __init__(self) -> None:
        self.queued = 0  # prompt tokens per prefill pod
        self.running = 0  # sequences per decode pod
        self.busy: set[str] = set()  # pods with a stream in flight whatever the role's load
        self.reads: list[str] = []

    def __call__(self, pod: str, role: str, revision: str, url: Any, token: Any) -> PodLoad:
        self.reads.append(pod)
        running = self.running if role == "decode" else 0
        running += pod in self.busy
        report = LoadReport(
            role=role, revision=revision, waiting_requests=0,
            queued_prompt_tokens=self.queued if role == "prefill" else 0,
            running_sequences=running, pages_used=running, pages_total=100,
            time_to_first_token_p90_seconds=None, inter_token_latency_p90_seconds=None,
            window_seconds=60,
        )  # fmt: skip
        return PodLoad(pod, role, revision, report, read_at=time.time())


class ScalingGate(Gate):
    """Gate, with as many pods per Deployment as its replicas (each its own IP), and a
    scale-down removing the pods of lowest deletion cost first, as a ReplicaSet does."""

    def __init__(self, autoscaling: dict[str, Any]) -> None:
        super().__init__()
        self.obj["spec"]["autoscaling"] = autoscaling
        self.loads = Loads()
        self.reconciler.read_load = self.loads

    def play(self) -> None:
        super().play()
        for (kind, name), obj in list(self.kube.objects.items()):
            if kind != "Deployment":
                continue
            labels = obj["metadata"]["labels"]
            uid = obj["metadata"]["uid"]
            pods = sorted(
                (p for (k, _), p in self.kube.objects.items() if k == "Pod"
                 and p["metadata"]["ownerReferences"][0]["uid"] == uid),
                key=lambda p: (_cost(p), -int(p["metadata"]["name"].rsplit("-", 1)[1])),
            )  # fmt: skip
            replicas = obj["spec"].get("replicas", 1)
            for pod in pods[: max(0, len(pods) - replicas)]:
                del self.kube.objects[("Pod", pod["metadata"]["name"])]
            taken = {int(p["metadata"]["name"].rsplit("-", 1)[1]) for p in pods}
            index = 0
            while len(taken) < replicas:
                if index not in taken:
                    named = f"{name}-{index}"
                    made = ready_pod(named, labels[LABEL_REVISION], Role(labels[LABEL_ROLE]), uid)
                    made["status"]["podIP"] = f"10.0.{len(name) % 200}.{index + 1}"
                    self.kube.objects[("Pod", named)] = made
                    taken.add(index)
                index += 1

    def pods(self, role: Role) -> list[dict[str, Any]]:
        prefix = f"tiny-{self.revision}-{role}-"
        return [p for (k, n), p in sorted(self.kube.objects.items()) if k == "Pod"
                and n.startswith(prefix)]  # fmt: skip

    def replicas(self, role: Role) -> int:
        deployment = self.child("Deployment", self.revision, role)
        assert deployment is not None
        return int(deployment["spec"]["replicas"])

    def backends(self) -> dict[str, Any]:
        configmap = self.child("ConfigMap", self.revision, Role.ROUTER)
        assert configmap is not None
        return dict(json.loads(configmap["data"][BACKENDS_FILE_NAME]))

    def serve(self) -> str:
        revision = self.revision
        self.verdicts[revision] = COMPLETE
        self.reconcile(6)
        assert self.condition("Ready")["status"] == "True", self.status
        return revision


def _cost(pod: dict[str, Any]) -> int:
    return int((pod["metadata"].get("annotations") or {}).get(POD_DELETION_COST, "0"))


@pytest.fixture(autouse=True)
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load read after the mark counts: the in-memory routers took the backends at once;
    and each pass decides on its own load (these passes run within a second of each other,
    where the operator's are seconds apart: smoothing has its own test)."""
    monkeypatch.setattr(draining, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(autoscaling, "SMOOTH_SECONDS", -1.0)


def test_a_load_step_scales_the_serving_revision_up_in_place_with_an_event() -> None:
    gate = ScalingGate(SCALING)
    revision = gate.serve()
    jobs = [k for k in gate.kube.objects if k[0] == "Job"]
    gate.loads.queued = 350  # 3.5x the target on the one prefill pod
    gate.reconcile()
    assert gate.replicas(Role.PREFILL) == 4
    assert gate.replicas(Role.DECODE) == 1
    [scaled] = gate.events_of(EventReason.SCALED)
    assert scaled.message == (
        "prefill: 1 -> 4 replicas: QueuedPromptTokens 350 prompt tokens queued per pod, target 100"
    )
    assert gate.status["autoscaling"]["prefill"] == {
        "current": 4, "desired": 4, "signal": "QueuedPromptTokens", "value": 350.0,
        "target": 100.0, "lastScaleTime": gate.status["autoscaling"]["prefill"]["lastScaleTime"],
        "summary": "4/4",
    }  # fmt: skip
    # no rollout: the same revision, no other canary Job, Ready throughout
    assert gate.revision == revision and gate.status["revision"] == {"current": revision}
    assert [k for k in gate.kube.objects if k[0] == "Job"] == jobs
    gate.reconcile()
    assert gate.condition("Ready")["status"] == "True"
    assert len(gate.backends()["prefill"]) == 4


def test_a_scale_down_drains_the_idlest_pods_first_and_lowers_replicas_once_they_finish() -> None:
    gate = ScalingGate(SCALING)
    gate.serve()
    gate.loads.queued = 350
    gate.reconcile(2)
    assert gate.replicas(Role.PREFILL) == 4 and len(gate.backends()["prefill"]) == 4
    pods = [p["metadata"]["name"] for p in gate.pods(Role.PREFILL)]
    busy = pods[1]
    gate.loads.queued, gate.loads.busy = 0, {busy}
    gate.reconcile()
    # three pods marked, the busy one not among them; out of the routers, still running
    marked = [p["metadata"]["name"] for p in gate.pods(Role.PREFILL)
              if ANNOTATION_DRAINING in (p["metadata"].get("annotations") or {})]  # fmt: skip
    assert len(marked) == 3 and busy not in marked
    assert gate.replicas(Role.PREFILL) == 4
    assert len(gate.backends()["prefill"]) == 1
    [drain] = gate.events_of(EventReason.DRAINING)
    assert all(name in drain.message for name in marked)
    assert gate.status["autoscaling"]["prefill"]["desired"] == 1
    assert sorted(gate.status["autoscaling"]["prefill"]["draining"]) == sorted(marked)
    # one of them turns out to be serving a stream: the replicas wait for it
    gate.loads.busy = {busy, marked[0]}
    gate.reconcile()
    assert gate.replicas(Role.PREFILL) == 4
    assert gate.status["autoscaling"]["prefill"]["draining"] == [marked[0]]
    # it finished: the replicas go down, and the ReplicaSet removes exactly the marked pods
    gate.loads.busy = {busy}
    gate.reconcile()
    assert gate.replicas(Role.PREFILL) == 1
    assert [p["metadata"]["name"] for p in gate.pods(Role.PREFILL)] == [busy]
    assert gate.condition("Ready")["status"] == "True"


def test_a_load_back_before_the_drain_ends_puts_the_pods_back_in_the_routers() -> None:
    gate = ScalingGate(SCALING)
    gate.serve()
    gate.loads.queued = 350
    gate.reconcile(2)
    gate.loads.queued, gate.loads.busy = 0, {p["metadata"]["name"] for p in gate.pods(Role.PREFILL)}
    gate.reconcile()
    assert len(gate.backends()["prefill"]) == 1
    gate.loads.queued = 350
    gate.reconcile()
    assert gate.replicas(Role.PREFILL) == 4 and len(gate.backends()["prefill"]) == 4
    assert not any(
        ANNOTATION_DRAINING in (p["metadata"].get("annotations") or {})
        for p in gate.pods(Role.PREFILL)
    )


def test_a_hand_edit_of_the_replicas_is_put_back_with_an_event() -> None:
    gate = ScalingGate(SCALING)
    gate.serve()
    gate.loads.running = 8  # 2x the decode target
    gate.reconcile()
    assert gate.replicas(Role.DECODE) == 2
    gate.loads.running = 4
    deployment = gate.child("Deployment", gate.revision, Role.DECODE)
    assert deployment is not None
    deployment["spec"]["replicas"] = 7  # kubectl scale
    gate.reconcile()
    assert gate.replicas(Role.DECODE) == 2
    [repaired] = gate.events_of(EventReason.REPLICAS_REPAIRED)
    assert repaired.type == "Warning"
    assert "set to 7 replicas by someone else: put back to 2" in repaired.message


def test_external_mode_leaves_the_replicas_to_the_users_autoscaler() -> None:
    gate = ScalingGate({"mode": "External"})
    gate.serve()
    deployment = gate.child("Deployment", gate.revision, Role.DECODE)
    assert deployment is not None
    deployment["spec"]["replicas"] = 3  # the user's HPA
    gate.kube.writes.clear()
    gate.reconcile(2)
    assert gate.replicas(Role.DECODE) == 3
    assert not [w for w in gate.kube.writes if w[1] == "Deployment"], gate.kube.writes
    assert not gate.events_of(EventReason.REPLICAS_REPAIRED)
    assert gate.status["autoscaling"]["mode"] == "External"
    assert gate.status["autoscaling"]["decode"]["current"] == 3
    assert not gate.loads.reads  # External: the operator reads no load


def test_a_candidate_runs_the_decided_count_and_only_the_serving_revision_scales() -> None:
    gate = ScalingGate(SCALING)
    old = gate.serve()
    gate.loads.running = 12  # 3x
    gate.reconcile()
    assert gate.replicas(Role.DECODE) == 3
    new = gate.set_spec(contextLength=2048, autoscaling=SCALING)
    gate.loads.reads.clear()
    gate.reconcile()
    decode = gate.child("Deployment", new, Role.DECODE)
    assert decode is not None and decode["spec"]["replicas"] == 3
    assert gate.loads.reads and all(f"-{old}-" in pod for pod in gate.loads.reads)


def test_changing_the_autoscaling_block_makes_no_revision() -> None:
    gate = ScalingGate(SCALING)
    revision = gate.revision
    gate.obj["spec"]["autoscaling"] = {**SCALING, "decode": {**SCALING["decode"], "target": 9}}
    assert gate.revision == revision
    del gate.obj["spec"]["autoscaling"]
    assert gate.revision == revision
