"""Leases on the test cluster, as `kvfence operator --leader-elect` uses them (the kubernetes
client's LeaseLock): created once, replaced only from the resourceVersion last read, and shown
by `kubectl get leases` with their holder as a kube-apiserver shows them."""

from typing import Any

import pytest

from helpers.kubectl_tables import cells
from kvfence_devcluster.fixtures import Cluster, ClusterApiError

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


def lease(holder: str) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "kvfence-operator"},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "acquireTime": "2026-12-01T01:00:00.000000Z",
            "renewTime": "2026-12-01T01:00:00.000000Z",
        },
    }


def test_a_lease_is_taken_once_and_replaced_only_from_the_version_last_read(
    cluster: Cluster,
) -> None:
    created = cluster.create(lease("operator-a"))
    # Two replicas racing for a new Lease: one create wins, the other is told it exists.
    assert cluster.request("POST", LEASES, json=lease("operator-b")).status_code == 409

    taken = {**created, "spec": {**created["spec"], "holderIdentity": "operator-b"}}
    replaced = cluster.replace(taken)
    assert replaced["spec"]["holderIdentity"] == "operator-b"
    assert int(replaced["metadata"]["resourceVersion"]) > int(
        created["metadata"]["resourceVersion"]
    )
    # A renewal from what the loser read before: refused, the holder stays.
    stale = {**created, "spec": {**created["spec"], "renewTime": "2026-12-01T01:00:02.000000Z"}}
    with pytest.raises(ClusterApiError) as refused:
        cluster.replace(stale)
    assert refused.value.status == 409
    found = cluster.get("Lease", "kvfence-operator", api_version="coordination.k8s.io/v1")
    assert found is not None and found["spec"]["holderIdentity"] == "operator-b"

    out = cluster.kubectl("get", "leases").stdout
    assert out.splitlines()[0].split() == ["NAME", "HOLDER", "AGE"]
    assert cells(out)[0][:2] == ["kvfence-operator", "operator-b"]
