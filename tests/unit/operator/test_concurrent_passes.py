"""kopf runs the sync timers of different InferenceDeployments at the same time, in its thread
pool, on the one Reconciler the startup handler put in `memo`. Each pass's findings (the errors
the API answered, the names someone else holds) must stay that pass's: one object's problem
never reaches another object's status or events."""

import threading
from typing import Any

from helpers.memory_kube import MemoryKube
from helpers.reconciling import never_probed
from kvfence_operator.builders.secret import secret_name
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.meta import Instance
from kvfence_operator.reconcile.reconciler import Reconciler
from kvfence_operator.revision import revision_of


def spec(name: str) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"source": "builtin:tiny-random"},
            "contextLength": 512,
            "router": {"apiKeysSecret": f"{name}-keys"},
        }
    )


def body(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "generation": 1},
        "spec": spec(name).model_dump(mode="json", by_alias=True, exclude_none=True),
    }


class PausingKube(MemoryKube):
    """Holds the pass that reads `pause_at` until `resume` is set: the other pass runs whole
    in between, as two threads of kopf's pool may interleave."""

    def __init__(self, *objects: dict[str, Any], pause_at: tuple[str, str]) -> None:
        super().__init__(*objects)
        self.pause_at = pause_at
        self.paused = threading.Event()
        self.resume = threading.Event()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        if (kind, name) == self.pause_at and not self.paused.is_set():
            self.paused.set()
            assert self.resume.wait(10), "the other pass never finished"
        return super().get(api_version, kind, namespace, name)


def test_two_objects_passes_at_once_keep_their_own_problems_and_conflicts():
    # a: its apiKeysSecret is missing and its revision Secret's name is someone else's;
    # b: nothing is wrong with it
    taken = secret_name(Instance("a", "default", "uid-a"), revision_of(spec("a")))
    foreign = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": taken, "uid": "x"}}
    b_keys = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "b-keys"}, "data": {}}
    kube = PausingKube(foreign, b_keys, pause_at=("Service", "b"))
    reconciler = Reconciler(kube, "kvfence-system", read_pool=never_probed)

    outcomes: dict[str, Any] = {}
    b = threading.Thread(target=lambda: outcomes.update(b=reconciler.reconcile(body("b"))))
    b.start()
    assert kube.paused.wait(10), "b's pass never read its stable Service"
    outcomes["a"] = reconciler.reconcile(body("a"))  # whole, while b's pass is held
    kube.resume.set()
    b.join(10)
    assert not b.is_alive()

    def degraded(name: str) -> tuple[str, str, str]:
        c = next(c for c in outcomes[name].status.conditions if c.type == "Degraded")
        return str(c.status), c.reason, c.message

    # a's own problems are a's
    status, reason, message = degraded("a")
    assert (status, reason) == ("True", "NameConflict") and taken in message
    assert {e.reason for e in outcomes["a"].events} >= {"ApiKeysSecretMissing", "NameConflict"}
    # and none of them is b's
    status, reason, message = degraded("b")
    assert (status, reason) == ("False", "AsExpected"), message
    assert "a-keys" not in message and taken not in message
    assert not [e for e in outcomes["b"].events if e.type == "Warning"], outcomes["b"].events
    created = {
        name for verb, kind, name in kube.writes if verb == "create" and kind == "Deployment"
    }
    assert any(name.startswith("b-") for name in created), created
