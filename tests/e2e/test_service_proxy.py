"""The test cluster's kube-proxy (kvfence_devcluster/proxy.py): a Service's clusterIP is a
loopback address that really reaches its ready pods, and follows them."""

import ipaddress
import socket

import httpx
import pytest

from helpers.web_pods import GATE, pod, service
from kvfence_devcluster.fixtures import Cluster, ClusterApiError


def set_gate(cluster: Cluster, name: str, status: str) -> None:
    def write() -> bool:
        current = cluster.require("Pod", name)
        others = [c for c in current["status"].get("conditions") or [] if c["type"] != GATE]
        patch = {
            "metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
            "status": {"conditions": [*others, {"type": GATE, "status": status}]},
        }
        cluster.patch("Pod", name, patch, subresource="status")  # 409 if the kubelet wrote first
        return True

    cluster.wait_for(write, f"the {GATE} gate of {name} to be {status}")


def answer(url: str, client: httpx.Client | None = None) -> str:
    """The pod name that answered, or what went wrong."""
    try:
        response = (client or httpx).get(url, timeout=2.0)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}"
    return response.text


def answers(url: str, n: int = 6) -> set[str]:
    return {answer(url) for _ in range(n)}


def refused(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2.0).close()
    except ConnectionRefusedError:
        return True
    return False


def test_services_get_a_loopback_cluster_ip_of_their_own(cluster: Cluster):
    first = cluster.create(service("first", {"app": "a"}))["spec"]
    second = cluster.create(service("second", {"app": "b"}))["spec"]
    for spec in (first, second):
        address = ipaddress.ip_address(spec["clusterIP"])
        assert address.is_loopback and str(address) != "127.0.0.1"
        assert str(address).startswith("127.0.")
        assert spec["clusterIPs"] == [spec["clusterIP"]]
    assert first["clusterIP"] != second["clusterIP"]

    headless = cluster.create(service("headless", {"app": "a"}, clusterIP="None"))["spec"]
    assert headless["clusterIP"] == "None"

    # A write that leaves clusterIP out keeps the allocated one, as the API server does.
    current = cluster.require("Service", "first")
    current["spec"] = {"selector": {"app": "c"}, "ports": current["spec"]["ports"]}
    assert cluster.replace(current)["spec"]["clusterIP"] == first["clusterIP"]
    with pytest.raises(ClusterApiError) as changed:
        cluster.patch("Service", "first", {"spec": {"clusterIP": second["clusterIP"]}})
    assert changed.value.status == 422
    with pytest.raises(ClusterApiError) as taken:
        cluster.create(service("third", {"app": "c"}, clusterIP=second["clusterIP"]))
    assert taken.value.status == 422 and "already allocated" in str(taken.value)


def test_a_cluster_ip_reaches_ready_pods_and_follows_their_readiness(cluster: Cluster):
    web = cluster.create(service("web", {"app": "web"}, target_port=8080))  # by number
    address = web["spec"]["clusterIP"]
    url = f"http://{address}:8000/"
    for name in ("web-1", "web-2"):
        cluster.create(pod(name, {"app": "web"}, gated=True))
    cluster.wait_for(
        lambda: [
            cluster.pod_condition(cluster.require("Pod", n), "ContainersReady")
            for n in ("web-1", "web-2")
        ],
        "both pods' containers to be ready",
        until=lambda cs: all(c and c["status"] == "True" for c in cs),
    )
    # Running but not Ready (the gate): no endpoint, so the connection is refused, at once
    # (refused, not accepted and left hanging: a connect that times out raises instead).
    assert refused(address, 8000)

    set_gate(cluster, "web-1", "True")
    cluster.wait_for(lambda: answer(url), "web-1 to answer", until=lambda a: a == "web-1")
    assert answers(url) == {"web-1"}

    set_gate(cluster, "web-2", "True")
    cluster.wait_for(
        lambda: answers(url), "both pods to answer", until=lambda a: a == {"web-1", "web-2"}
    )

    set_gate(cluster, "web-1", "False")
    cluster.wait_for(lambda: answers(url), "only web-2", until=lambda a: a == {"web-2"})

    cluster.delete("Pod", "web-2")
    cluster.wait_for(lambda: refused(address, 8000), "no endpoint left: refused")


def test_a_selector_change_moves_new_connections_and_open_ones_finish(cluster: Cluster):
    cluster.create(pod("blue", {"app": "x", "rev": "blue"}))
    cluster.create(pod("green", {"app": "x", "rev": "green"}))
    address = cluster.create(service("x", {"app": "x", "rev": "blue"}))["spec"]["clusterIP"]
    url = f"http://{address}:8000/"
    cluster.wait_for(lambda: answer(url), "blue to answer", until=lambda a: a == "blue")
    cluster.wait_for(
        lambda: cluster.require("Pod", "green"),
        "green to be Ready",
        until=lambda p: cluster.require_condition(p, "Ready")["status"] == "True",
    )
    with httpx.Client() as kept:  # one keep-alive connection, opened before the switch
        assert answer(url, kept) == "blue"
        cluster.patch("Service", "x", {"spec": {"selector": {"app": "x", "rev": "green"}}})
        cluster.wait_for(lambda: answers(url), "green only", until=lambda a: a == {"green"})
        assert answer(url, kept) == "blue", "an open connection stays with its pod"


# Prints the --target it was given (after the kubelet's rewrite) and what answered there.
FETCH = (
    "import sys, urllib.request; url = sys.argv[sys.argv.index('--target') + 1]; print(url); "
    "print(urllib.request.urlopen(url + '/').read().decode())"
)


def test_a_service_name_on_a_command_line_leads_to_its_cluster_ip(cluster: Cluster):
    address = cluster.create(service("web", {"app": "web"}))["spec"]["clusterIP"]
    cluster.create(pod("web-1", {"app": "web"}))
    cluster.wait_for(
        lambda: answer(f"http://{address}:8000/"), "web-1 to answer", until=lambda a: a == "web-1"
    )
    container = {
        "name": "fetch",
        "image": "python:3.11",
        "command": ["python", "-c", FETCH, "--target", "http://web.default.svc:8000"],
    }
    fetch = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "fetch"},
        "spec": {"restartPolicy": "Never", "containers": [container]},
    }
    cluster.create(fetch)
    done = cluster.wait_for(
        lambda: cluster.require("Pod", "fetch")["status"].get("phase"),
        "the fetch pod to finish",
        until=lambda phase: phase in ("Succeeded", "Failed"),
    )
    log = cluster.pod_log("fetch").splitlines()
    assert done == "Succeeded", log
    assert log[-2:] == [f"http://{address}:8000", "web-1"]


def test_a_service_port_taken_on_every_address_still_gets_a_cluster_ip(cluster: Cluster):
    with socket.socket() as squatter:  # something of this machine's on 0.0.0.0:<port>
        squatter.bind(("0.0.0.0", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        body = service("squatted", {"app": "web"})
        body["spec"]["ports"][0]["port"] = port
        address = cluster.create(body)["spec"]["clusterIP"]
        assert ipaddress.ip_address(address).is_loopback and address != "127.0.0.1"
