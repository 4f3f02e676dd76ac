"""Issue 26 item 5: a new operator (a restart, a leader handover, every chart rolling update)
closes no healthy gate. Its first pass may not have read a pool yet (its probes run off the
pass, 0.5 s); "unknown" then left serving pods' kv-pool gates False and pushed the routers an
empty backend set. Against the real Reconciler and the in-memory API server (helpers/gate)."""

from typing import Any

from helpers.gate import COMPLETE, Gate
from kvfence_operator.decisions.pool_gate import PodPool
from kvfence_operator.meta import KV_POOL_GATE
from kvfence_operator.reconcile.reconciler import Reconciler


def still_probing(pod: str, role: str, revision: str, *_: Any) -> PodPool:
    """A new operator's first passes: no probe has finished."""
    return PodPool(pod, role, revision, error="probing")


def gates(gate: Gate) -> dict[str, str]:
    return {
        name: next(c["status"] for c in pod["status"]["conditions"] if c["type"] == KV_POOL_GATE)
        for (kind, name), pod in gate.kube.objects.items()
        if kind == "Pod" and "router" not in name
    }


def serving() -> tuple[Gate, list[tuple[list[str], Any]]]:
    gate = Gate()
    gate.verdicts[gate.revision] = COMPLETE
    gate.reconcile(6)
    assert gate.condition("Ready")["status"] == "True"
    assert set(gates(gate).values()) == {"True"}
    pushed: list[tuple[list[str], Any]] = []
    gate.reconciler = Reconciler(  # the new leader: nothing read yet
        gate.kube,
        gate.reconciler.operator_namespace,
        read_pool=still_probing,
        push_backends=lambda routers, backends, _token: pushed.append((list(routers), backends)),
        credentials_key=gate.reconciler.credentials_key,
    )
    gate.kube.writes.clear()
    return gate, pushed


def test_a_new_operators_first_passes_keep_healthy_gates_and_backends():
    gate, pushed = serving()
    gate.reconcile(3)
    assert set(gates(gate).values()) == {"True"}
    assert not [w for w in gate.kube.writes if w[:2] in (("patch", "Pod"), ("patch", "ConfigMap"))]
    assert all(backends.prefill and backends.decode for _, backends in pushed), pushed
    assert not gate.events_of("PoolUnknown")
    assert gate.condition("Ready")["status"] == "True"


def test_a_gate_judged_for_an_earlier_instance_of_the_engine_is_not_kept():
    """The engine container restarted after its gate was set: its pool is unread, so not
    judged; only the gate of the instance it was judged for holds."""
    gate, _ = serving()
    pod = next(p for (k, n), p in gate.kube.objects.items() if k == "Pod" and "decode" in n)
    (engine,) = pod["status"]["containerStatuses"]
    engine.update(restartCount=1, state={"running": {"startedAt": "2099-01-01T00:00:00Z"}})
    gate.reconcile()
    assert gates(gate)[pod["metadata"]["name"]] == "False"


def test_a_gate_whose_engine_is_not_ready_is_not_kept():
    gate, _ = serving()
    pod = next(p for (k, n), p in gate.kube.objects.items() if k == "Pod" and "prefill" in n)
    pod["status"]["containerStatuses"][0]["ready"] = False  # the kubelet's probe fails: hung
    gate.reconcile()
    assert gates(gate)[pod["metadata"]["name"]] == "False"
