"""Issue 26 item 6: an operator upgrade whose builders write Deployments differently rolls no
kept revision (decisions/declaration.py). Each case runs the real Reconciler against the
in-memory API server (helpers/gate.py); the "new release" is this one with one builder change:
every engine container gets one more flag."""

import copy
from typing import Any

import pytest

from helpers.gate import COMPLETE, Gate
from kvfence_operator import builders
from kvfence_operator.crd.types import Role
from kvfence_operator.meta import ANNOTATION_DECLARED

NEW_FLAG = "--a-flag-of-the-next-release"


def new_release(monkeypatch: pytest.MonkeyPatch) -> None:
    earlier = builders.build_engine_deployment

    def build(*args: Any, **kwargs: Any) -> dict[str, Any]:
        deployment = earlier(*args, **kwargs)
        deployment["spec"]["template"]["spec"]["containers"][0]["args"].append(NEW_FLAG)
        return deployment

    monkeypatch.setattr(builders, "build_engine_deployment", build)


def engine(gate: Gate, revision: str, role: Role = Role.DECODE) -> dict[str, Any]:
    deployment = gate.child("Deployment", revision, role)
    assert deployment is not None
    return deployment["spec"]["template"]["spec"]["containers"][0]


def serving(credentials_key: bytes | None = b"the credentials key") -> tuple[Gate, str]:
    gate = Gate(credentials_key)
    r1 = gate.revision
    gate.verdicts[r1] = COMPLETE
    gate.reconcile(6)
    assert gate.status["revision"] == {"current": r1}
    return gate, r1


def deployment_patches(gate: Gate) -> list[tuple[str, str, str]]:
    return [w for w in gate.kube.writes if w[:2] == ("patch", "Deployment")]


def test_an_upgrade_whose_builders_changed_patches_no_serving_deployment(monkeypatch):
    gate, r1 = serving()
    before = copy.deepcopy(engine(gate, r1))
    new_release(monkeypatch)
    gate.kube.writes.clear()
    gate.reconcile(3)
    assert not deployment_patches(gate)
    assert engine(gate, r1) == before


def test_negative_control_without_a_record_the_upgrade_patches_every_engine(monkeypatch):
    gate, r1 = serving(credentials_key=None)  # no key: nothing is recorded
    new_release(monkeypatch)
    gate.kube.writes.clear()
    gate.reconcile()
    assert len(deployment_patches(gate)) == 2  # prefill and decode, pods replaced
    assert NEW_FLAG in engine(gate, r1)["args"]


def test_set_image_on_a_revision_an_earlier_release_built_is_put_back_as_it_was_built(
    monkeypatch,
):
    gate, r1 = serving()
    image = engine(gate, r1)["image"]
    new_release(monkeypatch)
    engine(gate, r1)["image"] = "registry.example/never-canaried:latest"
    gate.reconcile()
    assert engine(gate, r1)["image"] == image
    assert NEW_FLAG not in engine(gate, r1)["args"]


def test_a_record_that_does_not_verify_is_ignored_and_the_deployment_declared_anew(monkeypatch):
    """Someone edits the template and writes a record of the edit: without the key it is not
    sealed, so the edit is put back, by this release's builders."""
    gate, r1 = serving()
    new_release(monkeypatch)
    deployment = gate.child("Deployment", r1, Role.DECODE)
    assert deployment is not None
    seal, _, payload = deployment["metadata"]["annotations"][ANNOTATION_DECLARED].partition(".")
    deployment["metadata"]["annotations"][ANNOTATION_DECLARED] = f"{seal[::-1]}.{payload}"
    engine(gate, r1)["image"] = "registry.example/never-canaried:latest"
    gate.reconcile()
    assert engine(gate, r1)["image"] != "registry.example/never-canaried:latest"
    assert NEW_FLAG in engine(gate, r1)["args"]  # declared by this release
    assert engine(gate, r1, Role.PREFILL)["args"][-1] != NEW_FLAG  # its record held


def test_the_next_revision_is_built_by_the_new_release_and_the_serving_one_stays(monkeypatch):
    gate, r1 = serving()
    new_release(monkeypatch)
    r2 = gate.set_spec(contextLength=2048)
    gate.reconcile(4)
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert NEW_FLAG in engine(gate, r2)["args"]
    assert NEW_FLAG not in engine(gate, r1)["args"]
    gate.verdicts[r2] = COMPLETE
    gate.reconcile(3)
    assert gate.status["revision"] == {"current": r2}
    assert not gate.exists(r1)
