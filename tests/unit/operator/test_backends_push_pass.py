"""What the operator pushes to routers (router_push): the version of a backends set, which pods
may be given to a router or pushed to, and that a push failure never fails the pass."""

import base64
import logging
from typing import Any

import pytest

from helpers.memory_kube import MemoryKube
from helpers.reconciling import sufficient
from kvfence_engine.contracts import BackendsFile
from kvfence_engine.tools.localproc import free_port
from kvfence_operator.builders.secret import secret_name
from kvfence_operator.cluster.router_push import push_backends, versioned, written_backends
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.decisions.pods import may_serve
from kvfence_operator.meta import Instance, child_name, selector
from kvfence_operator.reconcile.reconciler import Reconciler
from kvfence_operator.revision import revision_of

WANTED = BackendsFile(revision="r1", context_length=1024, prefill=["http://p"], decode=["http://d"])
NOW_MS = 1_800_000_000_000


def test_an_unchanged_set_keeps_its_version_and_a_changed_one_gets_a_newer_one() -> None:
    written = WANTED.model_copy(update={"version": NOW_MS - 5000})
    assert versioned(WANTED, written, NOW_MS).version == NOW_MS - 5000  # nothing to push
    changed = WANTED.model_copy(update={"decode": []})
    assert versioned(changed, written, NOW_MS).version == NOW_MS
    # a clock behind the written version (a skewed node): still newer than what was written
    assert versioned(changed, written, NOW_MS - 10_000).version == NOW_MS - 4999
    # no ConfigMap yet, or one whose file does not read: starts from the clock
    assert versioned(WANTED, None, NOW_MS).version == NOW_MS
    # the ConfigMap as first created (or recreated after a deletion) says 0: never kept, since
    # the routers may hold a newer set that a 0 could not replace
    assert versioned(WANTED, WANTED, NOW_MS).version == NOW_MS
    assert versioned(WANTED, written_backends("not json"), NOW_MS).version == NOW_MS
    assert written_backends(written.file_text()) == written
    assert written_backends(None) is None


def bare_pod(phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": "10.0.0.9"}}


def test_a_deleting_evicted_or_finished_pod_is_never_given_to_a_router() -> None:
    assert may_serve(bare_pod()) and may_serve(bare_pod("Pending"))
    assert not may_serve(bare_pod(deleting=True))
    assert not may_serve(bare_pod("Failed"))  # evicted: its IP may be another pod's now
    assert not may_serve(bare_pod("Succeeded"))


def test_a_router_that_cannot_be_reached_is_logged_and_the_pass_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, "kvfence_operator.cluster.router_push"):
        push_backends([dead], WANTED, "token")
        push_backends([dead], WANTED, None)
    assert f"backends not pushed to router {dead}" in caplog.text
    assert "backends of revision r1 not pushed: no internal token" in caplog.text


# ---- a pass: what is written and pushed for its revision ---------------------------------

INSTANCE = Instance("tiny", "default", "uid-infd")
SPEC = InferenceDeploymentSpec.model_validate(
    {
        "model": {"source": "builtin:tiny-random"},
        "contextLength": 1024,
        "router": {"apiKeysSecret": "keys"},
    }
)
REVISION = revision_of(SPEC)
BODY = {
    "metadata": {"name": "tiny", "namespace": "default", "uid": "uid-infd", "generation": 1},
    "spec": SPEC.model_dump(mode="json", by_alias=True, exclude_none=True),
}
OWNER = {"kind": "InferenceDeployment", "name": "tiny", "uid": "uid-infd", "controller": True}


def deployment(role: Role) -> dict[str, Any]:
    name = child_name(INSTANCE, REVISION, role)
    return {"kind": "Deployment", "metadata": {"name": name, "uid": f"d-{role}",
                                               "ownerReferences": [OWNER]}}  # fmt: skip


def pod(role: Role, index: int, ip: str, phase: str = "Running", deleting: bool = False) -> Any:
    meta: dict[str, Any] = {
        "name": f"{role}-{index}",
        "labels": selector(INSTANCE, REVISION, role),
        "ownerReferences": [{"kind": "Deployment", "uid": f"d-{role}", "controller": True}],
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    ports = [{"name": "http", "containerPort": 8000}]
    return {"kind": "Pod", "metadata": meta, "spec": {"containers": [{"ports": ports}]},
            "status": {"phase": phase, "podIP": ip, "conditions": []}}  # fmt: skip


def test_each_pass_pushes_its_set_to_the_revisions_live_routers_only() -> None:
    secret = {"kind": "Secret", "metadata": {"name": secret_name(INSTANCE, REVISION),
              "ownerReferences": [OWNER]},
              "data": {"internal-token": base64.b64encode(b"tok").decode()}}  # fmt: skip
    cluster = MemoryKube(
        secret,
        *(deployment(role) for role in (Role.PREFILL, Role.DECODE, Role.ROUTER)),
        pod(Role.PREFILL, 0, "10.0.0.1"),
        pod(Role.DECODE, 0, "10.0.0.2"),
        pod(Role.DECODE, 1, "10.0.0.3", phase="Failed"),  # evicted, IP not yet released
        pod(Role.DECODE, 2, "10.0.0.4", phase="Succeeded"),
        pod(Role.ROUTER, 0, "10.0.0.10"),
        pod(Role.ROUTER, 1, "10.0.0.11", phase="Pending"),  # Ready or not: it gets the set
        pod(Role.ROUTER, 2, "10.0.0.12", deleting=True),
        pod(Role.ROUTER, 3, "10.0.0.13", phase="Failed"),
    )
    pushes: list[tuple[list[str], BackendsFile, str | None]] = []
    reconciler = Reconciler(
        cluster,
        "kvfence-system",
        read_pool=sufficient,
        push_backends=lambda urls, file, token: pushes.append((list(urls), file, token)),
    )
    reconciler.reconcile(BODY)
    [(urls, pushed, token)] = pushes
    assert urls == ["http://10.0.0.10:8000", "http://10.0.0.11:8000"]
    assert token == "tok"
    assert (pushed.prefill, pushed.decode) == (["http://10.0.0.1:8000"], ["http://10.0.0.2:8000"])
    configmap = cluster.objects[("ConfigMap", child_name(INSTANCE, REVISION, Role.ROUTER))]
    assert configmap["data"]["backends.json"] == pushed.file_text()  # the same, same version

    reconciler.reconcile(BODY)  # nothing changed: the same version
    assert pushes[1][1] == pushed
    del cluster.objects[("Pod", "decode-0")]
    reconciler.reconcile(BODY)
    assert pushes[2][1].decode == [] and pushes[2][1].version > pushed.version
