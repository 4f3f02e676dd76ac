"""A Kubernetes test cluster on localhost: an API server emulator built on kmock, and a kubelet
that runs each Pod as local processes.

    from kvfence_devcluster.fixtures import cluster_fixture  # noqa: F401  (pytest: `cluster`)

    def test_x(cluster):
        cluster.create(manifest)                                # any kind, 201 + server fields
        cluster.get("Pod", name)                                # the object, or None
        pod = cluster.wait_for(lambda: cluster.require("Pod", name), "the pod to be Ready",
                               until=lambda p: cluster.pod_condition(p, "Ready")...)
        httpx.get(cluster.pod_url(pod) + "/readyz")             # http://127.0.0.1:<its port>
        operator = cluster.start_operator(["--standalone", "-A"])  # KUBECONFIG=cluster.kubeconfig
        operator.kill()                                         # a crash; start_operator again

Or `with start_cluster(path, kubelet=KubeletOptions(...)) as cluster:` outside pytest.
"""

from .apiserver import ApiServer, write_kubeconfig
from .fixtures import Cluster, ClusterApiError, cluster_fixture, start_cluster
from .kubelet import Kubelet
from .options import KubeletOptions
from .processes import ManagedProcess
from .resources import ApiError, ResourceType
from .store import Store

__all__ = [
    "ApiError",
    "ApiServer",
    "Cluster",
    "ClusterApiError",
    "Kubelet",
    "KubeletOptions",
    "ManagedProcess",
    "ResourceType",
    "Store",
    "cluster_fixture",
    "start_cluster",
    "write_kubeconfig",
]
