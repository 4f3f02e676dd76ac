"""Revision credentials derived from the operator's credentials key: the operator creates each
revision's Secret and never reads one in a workload namespace (no cluster-wide Secret `get`);
the API keys Secret's existence is asked with a dry-run create. A revision made by an older
operator (random credentials, no mark on its router ConfigMap) is still read from its Secret."""

import base64
from types import SimpleNamespace
from typing import Any

import pytest

from helpers.memory_kube import MemoryKube
from kvfence_engine.contracts import PoolGateReport
from kvfence_operator.app.handlers import _report_degraded
from kvfence_operator.builders.secret import (
    CREDENTIALS_MARK,
    INTERNAL_TOKEN_KEY,
    RevisionCredentials,
    derived_mark,
    secret_name,
)
from kvfence_operator.cluster.kube import KubeError
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.decisions.findings import CredentialsUnreadable
from kvfence_operator.decisions.pool_gate import PodPool
from kvfence_operator.meta import Instance, child_name, selector
from kvfence_operator.reconcile.reconciler import Reconciler
from kvfence_operator.revision import revision_of

KEY = b"the operator's credentials key, 43 characters"
INSTANCE = Instance("tiny", "default", "uid-infd")
SPEC_DICT = {
    "model": {"source": "builtin:tiny-random"},
    "contextLength": 1024,
    "router": {"apiKeysSecret": "keys"},
    "canary": {"enabled": False},
}
SPEC = InferenceDeploymentSpec.model_validate(SPEC_DICT)
REVISION = revision_of(SPEC)
OWNER = {"kind": "InferenceDeployment", "name": "tiny", "uid": "uid-infd", "controller": True}
KEYS = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys"}, "data": {}}


def body() -> dict[str, Any]:
    meta = {"name": "tiny", "namespace": "default", "uid": "uid-infd", "generation": 1}
    return {"metadata": meta, "spec": SPEC_DICT}


def test_derived_credentials_differ_by_purpose_revision_object_and_key():
    one = RevisionCredentials.derive(KEY, INSTANCE, REVISION)
    assert one == RevisionCredentials.derive(KEY, INSTANCE, REVISION)
    assert len({one.internal_token, one.tenant_a_key, one.tenant_b_key}) == 3
    recreated = Instance(INSTANCE.name, INSTANCE.namespace, "another-uid")
    others = [
        RevisionCredentials.derive(KEY, INSTANCE, "0123456789"),
        RevisionCredentials.derive(KEY, recreated, REVISION),
        RevisionCredentials.derive(b"another key", INSTANCE, REVISION),
    ]
    assert all(o.internal_token != one.internal_token for o in others)
    assert derived_mark(KEY) != derived_mark(b"another key") and KEY.decode() not in derived_mark(
        KEY
    )


def pool_reader(seen: list[str | None]) -> Any:
    def read(pod: str, role: str, revision: str, url: str | None, token: str | None) -> PodPool:
        seen.append(token)
        report = PoolGateReport(role=role, revision=revision, pool_tokens=2048, page_size=16,
                                num_pages=128, context_length_effective=2048, tag_check=True,
                                deferred_release=True)  # fmt: skip
        return PodPool(pod, role, revision, report=report)

    return read


def engine_pod(role: Role, deployment_uid: str) -> dict[str, Any]:
    meta = {
        "name": f"{role}-0",
        "labels": selector(INSTANCE, REVISION, role),
        "ownerReferences": [{"kind": "Deployment", "uid": deployment_uid, "controller": True}],
    }
    ports = [{"name": "http", "containerPort": 8000}]
    return {"kind": "Pod", "metadata": meta, "spec": {"containers": [{"ports": ports}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": []}}  # fmt: skip


def with_engine_pods(kube: MemoryKube) -> None:
    for role in (Role.PREFILL, Role.DECODE):
        deployment = kube.objects[("Deployment", child_name(INSTANCE, REVISION, role))]
        kube.objects[("Pod", f"{role}-0")] = engine_pod(role, deployment["metadata"]["uid"])


def test_a_pass_with_the_credentials_key_reads_no_secret_and_probes_with_the_derived_token():
    kube = MemoryKube(KEYS)
    seen: list[str | None] = []
    reconciler = Reconciler(
        kube,
        "kvfence-system",
        read_pool=pool_reader(seen),
        push_backends=lambda *_: None,
        credentials_key=KEY,
    )
    reconciler.reconcile(body())
    with_engine_pods(kube)
    outcome = reconciler.reconcile(body())
    assert not [read for read in kube.reads if read[0] == "Secret"]
    derived = RevisionCredentials.derive(KEY, INSTANCE, REVISION)
    assert seen == [derived.internal_token] * 2
    secret = kube.objects[("Secret", secret_name(INSTANCE, REVISION))]
    assert base64.b64decode(secret["data"][INTERNAL_TOKEN_KEY]).decode() == derived.internal_token
    configmap = kube.objects[("ConfigMap", child_name(INSTANCE, REVISION, Role.ROUTER))]
    assert configmap["metadata"]["annotations"][CREDENTIALS_MARK] == derived_mark(KEY)
    assert ("Secret", "keys") not in [(k, n) for _, k, n in kube.writes]  # asked, not written
    degraded = next(c for c in outcome.status.conditions if c.type == "Degraded")
    assert degraded.reason != "ApiKeysSecretMissing"


def test_a_missing_api_keys_secret_is_still_reported_without_reading_secrets():
    kube = MemoryKube()
    reconciler = Reconciler(kube, "kvfence-system", read_pool=pool_reader([]), credentials_key=KEY)
    outcome = reconciler.reconcile(body())
    degraded = next(c for c in outcome.status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ApiKeysSecretMissing")
    assert ("Secret", "keys") not in kube.objects
    assert not [read for read in kube.reads if read[0] == "Secret"]


def test_a_revision_made_by_an_older_operator_is_probed_with_the_token_in_its_secret():
    legacy = MemoryKube(KEYS)
    seen: list[str | None] = []
    Reconciler(legacy, "kvfence-system", read_pool=pool_reader(seen)).reconcile(body())
    with_engine_pods(legacy)
    secret = legacy.objects[("Secret", secret_name(INSTANCE, REVISION))]
    random_token = base64.b64decode(secret["data"][INTERNAL_TOKEN_KEY]).decode()
    upgraded = Reconciler(
        legacy,
        "kvfence-system",
        read_pool=pool_reader(seen),
        push_backends=lambda *_: None,
        credentials_key=KEY,
    )
    upgraded.reconcile(body())
    assert seen == [random_token] * 2
    assert legacy.objects[("Secret", secret_name(INSTANCE, REVISION))] == secret  # untouched


class NoSecretReads(MemoryKube):
    """The API as the chart's default RBAC answers: Secret `get` is forbidden."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        if kind == "Secret":
            raise KubeError(403, "GET", f"/api/v1/namespaces/{namespace}/secrets/{name}", "")
        return super().get(api_version, kind, namespace, name)


def test_an_older_operators_revision_without_secret_get_stops_the_pass_before_any_gate():
    kube = MemoryKube(KEYS)
    Reconciler(kube, "kvfence-system", read_pool=pool_reader([])).reconcile(body())
    with_engine_pods(kube)
    forbidden = NoSecretReads()
    forbidden.objects = kube.objects
    seen: list[str | None] = []
    upgraded = Reconciler(
        forbidden,
        "kvfence-system",
        read_pool=pool_reader(seen),
        push_backends=lambda *_: None,
        credentials_key=KEY,
    )
    with pytest.raises(CredentialsUnreadable, match=r"rbac\.legacyRevisionSecrets=true"):
        upgraded.reconcile(body())
    assert seen == []  # never probed without its token: no gate was closed
    assert not [w for w in forbidden.writes if w[1] == "Pod"]


def test_unreadable_credentials_are_said_on_degraded_once_and_leave_ready_alone():
    ready = {"type": "Ready", "status": "True", "reason": "Serving", "message": "serving",
             "lastTransitionTime": "2026-12-01T00:00:00Z", "observedGeneration": 1}  # fmt: skip
    obj = {**body(), "status": {"conditions": [ready]}}
    patch: dict[str, Any] = {"status": {}}
    message = str(CredentialsUnreadable(REVISION, secret_name(INSTANCE, REVISION)))
    assert _report_degraded(obj, SimpleNamespace(**patch), "CredentialsUnreadable", message)  # type: ignore[arg-type]
    conditions = {c["type"]: c for c in patch["status"]["conditions"]}
    assert conditions["Ready"] == ready
    assert conditions["Degraded"]["status"] == "True"
    assert conditions["Degraded"]["reason"] == "CredentialsUnreadable"
    again: dict[str, Any] = {"status": {}}
    written = {**obj, "status": patch["status"]}
    assert not _report_degraded(written, SimpleNamespace(**again), "CredentialsUnreadable", message)  # type: ignore[arg-type]
    assert again["status"] == {}
