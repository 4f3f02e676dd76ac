"""What a pod is to the operator, read off the pod object alone: whether it still counts as one
of its revision's engines or routers, where it answers, which instance of its engine container
runs, and the kvfence.dev/kv-pool readiness gate condition to write on it."""

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kvfence_operator.decisions.pool_gate import PodGate
from kvfence_operator.meta import KV_POOL_GATE

TERMINAL_PHASES = ("Failed", "Succeeded")
ENGINE_CONTAINER = "engine"


def may_serve(pod: Mapping[str, Any]) -> bool:
    """A pod that can serve: not being deleted, not finished. An evicted pod (phase Failed,
    no IP) stays until pod GC, but is no engine of its revision: not probed, gated or counted;
    nor is its address given to a router or pushed to (its IP may be another pod's now)."""
    if pod["metadata"].get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") not in TERMINAL_PHASES


def pod_url(pod: Mapping[str, Any]) -> str | None:
    """http://<pod IP>:<the container port named http>."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return f"http://{ip}:{port['containerPort']}"
    return None


def container_instance(pod: Mapping[str, Any], container: str = ENGINE_CONTAINER) -> str:
    """One running instance of the pod's engine container: the pod UID with the container's
    ID and restart count (a restart changes both; an emulator may only give the count)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    engine: Mapping[str, Any] = next((s for s in statuses if s.get("name") == container), {})
    uid = (pod.get("metadata") or {}).get("uid") or (pod.get("metadata") or {}).get("name")
    return f"{uid}/{engine.get('containerID') or ''}/{int(engine.get('restartCount') or 0)}"


def pod_condition(pod: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), None)


def gate_patch(
    pod: Mapping[str, Any], gate: PodGate, now: datetime | None = None
) -> dict[str, Any] | None:
    """The pods/status merge patch that sets the gate condition, or None if it is already
    set. Merge patch replaces lists, so the whole conditions list is written, with the
    resourceVersion it was read at."""
    status = "True" if gate.sufficient else "False"
    old = pod_condition(pod, KV_POOL_GATE)
    if old is not None and (old.get("status"), old.get("message")) == (status, gate.message):
        return None
    stamp = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    new = {
        "type": KV_POOL_GATE,
        "status": status,
        "reason": gate.reason,
        "message": gate.message,
        "lastProbeTime": None,
        "lastTransitionTime": (
            old["lastTransitionTime"] if old and old.get("status") == status else stamp
        ),
    }
    others = [
        c
        for c in (pod.get("status") or {}).get("conditions") or []
        if c.get("type") != KV_POOL_GATE
    ]
    return {
        "metadata": {"resourceVersion": pod["metadata"].get("resourceVersion")},
        "status": {"conditions": [*others, new]},
    }


def gate_flipped(pod: Mapping[str, Any], gate: PodGate) -> bool:
    """Whether writing `gate` changes the gate's status (an Event says so), not only its
    message."""
    old = pod_condition(pod, KV_POOL_GATE)
    return old is None or old.get("status") != ("True" if gate.sufficient else "False")
