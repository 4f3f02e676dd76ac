"""What a pod is to the operator, read off the pod object alone: whether it still counts as one
of its revision's engines or routers, where it answers, which instance of its engine container
runs, the kvfence.dev/kv-pool readiness gate condition to write on it, and its engine's last
failure."""

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvfence_operator.decisions.pool_gate import PodGate, PodPool
from kvfence_operator.meta import KV_POOL_GATE

TERMINAL_PHASES = ("Failed", "Succeeded")
ENGINE_CONTAINER = "engine"
MESSAGE_LIMIT = 500  # of a termination message's last line, in a condition and an Event


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


def gate_held(pod: Mapping[str, Any], pool: PodPool) -> bool:
    """Whether this pass must leave the pod's True gate as it is though it has no report of
    its pool: a new operator (a restart, a leader handover) whose probes have not finished
    yet, or a read that failed. It holds while the engine instance it was judged for runs and
    is ready: the gate turned True after that container started (a pool cannot change while
    its engine runs) and the kubelet's readiness probe passes (a hung engine's fails, and its
    gate is then judged like any other). "Unknown" never turns a True gate False."""
    if pool.report is not None:
        return False
    gate = pod_condition(pod, KV_POOL_GATE)
    if gate is None or gate.get("status") != "True":
        return False
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    engine = next((s for s in statuses if s.get("name") == ENGINE_CONTAINER), None)
    if engine is None or not engine.get("ready"):
        return False
    started = _time(((engine.get("state") or {}).get("running") or {}).get("startedAt"))
    since = _time(gate.get("lastTransitionTime"))
    return started is not None and since is not None and since >= started


def _time(stamp: object) -> datetime | None:
    try:
        return datetime.fromisoformat(str(stamp)) if stamp else None
    except ValueError:
        return None


def gate_event_due(pod: Mapping[str, Any], gate: PodGate) -> bool:
    """Whether writing `gate` is worth an Event: the pod starts taking traffic (True, for the
    first time or again), or a pod whose gate was True stops. A pod's first gate False is
    not: it is starting (no IP yet, its engine loading) or its revision's pools are refused,
    which the revision's own Event says once (status.pool_events), not once per pod."""
    old = pod_condition(pod, KV_POOL_GATE)
    if gate.sufficient:
        return old is None or old.get("status") != "True"
    return old is not None and old.get("status") == "True"


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """An engine container that exited with an error and has not been ready since."""

    pod: str
    exit_code: int
    reason: str  # the container's own last words: its termination message, else the kubelet's


def engine_failure(pod: Mapping[str, Any]) -> EngineFailure | None:
    """The engine container's last failure, while it has not been ready since: its exit code
    and its termination message (`kvfence serve` writes its last error to --termination-log,
    and the builders set FallbackToLogsOnError, so a message is there either way), its last
    line. Read from `state` (a container that is not restarted) or `lastState` (one waiting
    in CrashLoopBackOff, or running again but not ready yet): the same failure on every pass
    until the container is ready, so Degraded and its Event do not flicker with restarts."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    engine = next((s for s in statuses if s.get("name") == ENGINE_CONTAINER), None)
    if engine is None or engine.get("ready"):
        return None
    terminated = ((engine.get("state") or {}).get("terminated")
                  or (engine.get("lastState") or {}).get("terminated"))  # fmt: skip
    if not terminated or not terminated.get("exitCode"):
        return None
    lines = [line.strip() for line in str(terminated.get("message") or "").splitlines()]
    said = next((line for line in reversed(lines) if line), "")
    reason = said[:MESSAGE_LIMIT] or str(terminated.get("reason") or "no termination message")
    return EngineFailure(pod["metadata"]["name"], int(terminated["exitCode"]), reason)
