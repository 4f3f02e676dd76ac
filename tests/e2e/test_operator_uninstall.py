"""Uninstalling the operator leaves nothing stuck: `helm uninstall` deletes the operator's
Deployment (its pod gets SIGTERM) and keeps the CRD; the user then deletes the namespaces and
the CRD. An InferenceDeployment carrying a finalizer nobody removes any more would stay in
Terminating, and with it its namespace and the CRD. The operator sets none: its children go
through ownerReferences and the garbage collector, so it has nothing to do at deletion.

The API server only (no kubelet): what is tested is the InferenceDeployment's metadata and
the operator's children, not running pods."""

from typing import Any

from helpers.operators import Operator, start_operator
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_operator.crd.types import API_GROUP, API_VERSION, PLURAL

NAMESPACE = "team-a"
NAME = "tiny"
KIND, GROUP_VERSION = "InferenceDeployment", f"{API_GROUP}/{API_VERSION}"
INTERVAL = "0.5"  # seconds between reconcile passes (KVFENCE_RECONCILE_INTERVAL)
CHILD_KINDS = ("Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy", "Job")


def manifest(name: str = NAME) -> dict[str, Any]:
    return {
        "apiVersion": GROUP_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "engine": {"kvCacheMemory": str(96 * 16 * 768)},
            "contextLength": 1024,
            "router": {"apiKeysSecret": f"{name}-keys"},
        },
    }


def start(cluster: Cluster, finalizers: list[str] | None = None) -> Operator:
    """`finalizers`: the InferenceDeployment exists with them before the operator starts."""
    cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    if finalizers is not None:
        obj = manifest()
        obj["metadata"]["finalizers"] = finalizers
        cluster.create(obj)
    operator = start_operator(
        cluster,
        ["--standalone", "--namespace", NAMESPACE],
        {"KVFENCE_RECONCILE_INTERVAL": INTERVAL},
    )
    if finalizers is None:
        cluster.create(manifest())
    return operator


def children(cluster: Cluster, name: str = NAME) -> list[str]:
    """What the operator created for the InferenceDeployment (the API keys Secret is the
    user's and not labelled as the instance's)."""
    labels = {"app.kubernetes.io/instance": name}
    return [
        f"{kind}/{obj['metadata']['name']}"
        for kind in CHILD_KINDS
        for obj in cluster.list(kind, NAMESPACE, labels=labels)
    ]


def reconciled(cluster: Cluster) -> dict[str, Any]:
    """The InferenceDeployment once the operator wrote its status and created children."""
    return cluster.wait_for(
        lambda: cluster.require(KIND, NAME, NAMESPACE, api_version=GROUP_VERSION),
        "the operator's first reconcile pass (status and children)",
        timeout=60,
        until=lambda obj: (obj.get("status") or {}).get("conditions") and children(cluster),
    )


def kubectl_names(cluster: Cluster, *args: str) -> list[str]:
    return cluster.kubectl("get", *args, "-o", "name").stdout.split()


def test_uninstall_then_deleting_the_namespace_and_the_crd_leaves_nothing_terminating(
    tmp_path: Any,
) -> None:
    with start_cluster(tmp_path / "cluster", kubelet=False) as cluster:
        operator = start(cluster)
        obj = reconciled(cluster)
        assert not obj["metadata"].get("finalizers"), obj["metadata"]

        operator.stop()  # helm uninstall: the operator's Deployment goes, its pod gets SIGTERM
        assert not operator.running
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        cluster.wait_gone("Namespace", NAMESPACE)
        assert kubectl_names(cluster, PLURAL, "--all-namespaces") == []
        cluster.kubectl("delete", "crd", f"{PLURAL}.{API_GROUP}", "--wait=false")
        assert f"customresourcedefinition.apiextensions.k8s.io/{PLURAL}.{API_GROUP}" not in (
            kubectl_names(cluster, "crd")
        )


def test_deleting_an_inference_deployment_stops_its_reconcile_and_leaves_no_children(
    tmp_path: Any,
) -> None:
    """Without a finalizer, the operator learns of a deletion from the watch alone: it must
    stop reconciling the object then, or it would create the children again for an owner
    that is gone, every pass."""
    with start_cluster(tmp_path / "cluster", kubelet=False) as cluster:
        operator = start(cluster)
        reconciled(cluster)
        # another InferenceDeployment beside it, whose passes go on: the clock of this test
        cluster.create(manifest("witness"))
        cluster.wait_for(lambda: children(cluster, "witness"), "the witness's children")
        assert cluster.delete(KIND, NAME, NAMESPACE, api_version=GROUP_VERSION)
        cluster.wait_gone(KIND, NAME, NAMESPACE)
        cluster.wait_for(lambda: children(cluster), "the children collected", until=lambda c: not c)
        passes = operator.passes(NAME, NAMESPACE)  # a pass under way may still end: once
        operator.wait_passes(4, "witness", NAMESPACE)  # passes that would re-create them
        assert children(cluster) == []
        assert operator.passes(NAME, NAMESPACE) <= passes + 1, "the deleted one's timer ran on"


def test_the_finalizer_an_older_operator_set_is_removed_and_other_finalizers_are_kept(
    tmp_path: Any,
) -> None:
    """Upgrading from an operator that set kvfence.dev/finalizer: the new one removes it, so
    a later uninstall leaves nothing stuck either; someone else's finalizer is theirs."""
    with start_cluster(tmp_path / "cluster", kubelet=False) as cluster:
        start(cluster, finalizers=["example.com/keep", f"{API_GROUP}/finalizer"])
        obj = cluster.wait_for(
            lambda: reconciled(cluster),
            "kvfence.dev/finalizer removed",
            until=lambda o: f"{API_GROUP}/finalizer" not in (o["metadata"].get("finalizers") or []),
        )
        assert obj["metadata"]["finalizers"] == ["example.com/keep"]
