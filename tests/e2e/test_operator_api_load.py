"""The operator's steady-state API load (issue 15, item 1), counted at the API server's door:
`kvfence operator` talks to the test cluster through a recording proxy. Once an
InferenceDeployment is Ready, a pass reads its children from the watch-fed caches, POSTs
nothing, writes no unchanged status, and kopf writes nothing per timer run. On hollow pods
(kvfence_devcluster/hollow.py): the load is the operator's, whatever the engines are; the
passes are counted by the operator's own metrics, not guessed from the clock."""

from collections import Counter

import pytest

from helpers.counting_proxy import CountingProxy
from helpers.operators import start_operator
from helpers.tiny_infd import NAME, api_keys_secret, manifest, wait_condition
from helpers.waits import READY_S
from kvfence_devcluster.apiserver import write_kubeconfig

PASSES = 10


@pytest.mark.hollow
@pytest.mark.parametrize(
    ("args", "pods"),
    [
        (["--namespace", "default"], "/api/v1/namespaces/default/pods"),
        ([], "/api/v1/pods"),  # every namespace: one cluster-wide watch per kind
    ],
    ids=["namespace", "all-namespaces"],
)
def test_a_ready_deployment_costs_at_most_one_request_a_pass_and_no_writes(
    cluster, tmp_path, args, pods
):
    proxy = CountingProxy(cluster.url).start()
    try:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", proxy.url)
        cluster.create(api_keys_secret())
        operator = start_operator(cluster, ["--standalone", *args], {"KUBECONFIG": str(kubeconfig)})
        cluster.create(manifest(canary={"enabled": False}))
        wait_condition(cluster, "Ready", "True", timeout=READY_S)
        # the watches that the caches opened at start are not per pass
        assert pods in {s.path for s in proxy.seen if s.watch}
        wait_condition(cluster, "Progressing", "False", timeout=60)
        operator.wait_passes(3, NAME)  # the last gate and status writes of the rollout land
        start = len(proxy.seen)
        operator.wait_passes(PASSES, NAME)
        steady = [s for s in proxy.seen[start:] if not s.watch]
        assert operator.poll() is None
        operator.stop()
    finally:
        proxy.stop()
    verbs = Counter(s.method for s in steady)
    described = [f"{s.method} {s.path}" for s in steady]
    assert verbs["POST"] == 0, described
    assert [s for s in steady if s.method == "PATCH" and NAME in s.path] == [], described
    assert len(steady) <= PASSES, described  # at most one request a pass, on average
    print(f"steady: {len(steady)} requests in {PASSES} passes: {described}")
