"""The test API server counts every request it answers, by verb, resource and user agent
(kvfence_devcluster/counting.py): what bench/operator_scale.py reads as the operator's API
load."""

import httpx

from kvfence_devcluster.counting import RequestKey
from kvfence_devcluster.fixtures import Cluster

AGENT = "counting-test/1.0"


def test_every_request_is_counted_once_by_verb_resource_and_user_agent(cluster: Cluster) -> None:
    cluster.requests(reset=True)
    headers = {"User-Agent": f"{AGENT} (python)"}
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}, "data": {"k": "v"}}
    base = "/api/v1/namespaces/default/configmaps"
    deployments = "/apis/apps/v1/namespaces/default/deployments"
    with httpx.Client(base_url=cluster.url, headers=headers, timeout=30) as http:
        assert http.post(base, json=cm).status_code == 201
        assert http.post(base, json=cm).status_code == 409  # refused: still answered, counted
        assert http.get(f"{base}/a").status_code == 200
        assert http.get(f"{base}/missing").status_code == 404
        assert http.get(base).status_code == 200
        assert http.get(deployments).status_code == 200
        merge = {"Content-Type": "application/merge-patch+json"}
        assert http.patch(f"{base}/a", json={"data": {"k": "w"}}, headers=merge).status_code == 200
        current = http.get(f"{base}/a").json()
        assert http.put(f"{base}/a", json=current).status_code == 200
        # A watch counts once, when opened, whatever it streams until it ends.
        with http.stream("GET", base, params={"watch": "true", "timeoutSeconds": "1"}) as w:
            assert w.status_code == 200
            assert sum(1 for line in w.iter_lines() if line.strip()) >= 1
        assert http.get("/apis").status_code == 200
        assert http.delete(f"{base}/a").status_code == 200
        assert http.delete(base).status_code == 200
        status = "/apis/kvfence.dev/v1alpha1/namespaces/default/inferencedeployments/x/status"
        assert http.patch(status, json={}, headers=merge).status_code == 404

    counts = cluster.requests()
    assert counts.only([AGENT]).counts == {
        RequestKey("create", "configmaps", AGENT): 2,
        RequestKey("get", "configmaps", AGENT): 3,
        RequestKey("list", "configmaps", AGENT): 1,
        RequestKey("list", "deployments.apps", AGENT): 1,
        RequestKey("patch", "configmaps", AGENT): 1,
        RequestKey("update", "configmaps", AGENT): 1,
        RequestKey("watch", "configmaps", AGENT): 1,
        RequestKey("get", "/apis", AGENT): 1,
        RequestKey("delete", "configmaps", AGENT): 1,
        RequestKey("deletecollection", "configmaps", AGENT): 1,
        RequestKey("patch", "inferencedeployments.kvfence.dev/status", AGENT): 1,
    }
    assert counts.only([AGENT]).by("verb")[("get",)] == 4

    # The real kubectl is counted under its own user agent; reset starts from zero.
    cluster.requests(reset=True)
    cluster.kubectl("get", "configmaps", "-o", "name")
    kubectl = cluster.requests()
    assert kubectl.total >= 1
    assert all(k.user_agent.startswith("kubectl") for k in kubectl.counts)
    assert kubectl.by("verb", "resource")[("list", "configmaps")] == 1
    assert kubectl.only([AGENT]).total == 0

    # What happened between two snapshots.
    before = cluster.requests()
    cluster.get("ConfigMap", "a")
    between = cluster.requests() - before
    assert between.by("verb", "resource") == {("get", "configmaps"): 1}
