"""A Kubernetes test cluster on localhost: an API server emulator built on kmock, and a kubelet
that runs each Pod as local processes. See fixtures.py for the entry points."""

from .apiserver import ApiServer, write_kubeconfig
from .fixtures import Cluster, ClusterApiError, cluster_fixture, start_cluster
from .kubelet import Kubelet, KubeletOptions
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
