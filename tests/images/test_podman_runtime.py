"""The test cluster's podman runtime (kvfence_devcluster/podman.py): a pod's spec reaches its
container as a real kubelet would hand it over (env, envFrom, volumes, securityContext, the
service account, the termination message, the exit code), deleting a pod sends its container
SIGTERM, a missing image waits as ErrImageNeverPull, and no container outlives the cluster."""

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from helpers.images import OPERATOR
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.options import KubeletOptions

pytestmark = pytest.mark.images

# Runs in the operator image (python3 and the kubernetes client): reports what it sees.
INSIDE = """
import json, os, sys
from kubernetes import client, config
seen = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups())}
seen["capeff"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
seen["nnp"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("NoNewPrivs")][0]
for path in ("/written", "/tmp/written", "/etc/cfg/written"):
    try:
        open(path, "w").close()
        seen[path] = "ok"
    except OSError as e:
        seen[path] = e.strerror
seen["cfg"] = open("/etc/cfg/greeting").read()
seen["secret"] = open("/etc/sec/password").read()
seen["env"] = {k: os.environ.get(k) for k in ("PLAIN", "FROM_SECRET", "FROM_MAP", "POD", "HOME")}
config.load_incluster_config()
pods = client.CoreV1Api().list_namespaced_pod(os.environ["POD_NAMESPACE"])
seen["pods"] = sorted(p.metadata.name for p in pods.items)
print("SEEN " + json.dumps(seen), flush=True)
open("/dev/termination-log", "w").write("reported")
sys.exit(3)
"""

# Runs until SIGTERM, then says so and exits 0.
WAITS_FOR_TERM = """
import signal, sys, time
def stop(*_):
    print("got SIGTERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("waiting", flush=True)
while True:
    time.sleep(1)
"""


def pod(name: str, script: str, image: str = OPERATOR, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {"name": "main", "image": image, "command": ["python3", "-c", script], **spec}
            ],
        },
    }


def reporting_pod() -> dict[str, Any]:
    manifest = pod(
        "reporter",
        INSIDE,
        env=[
            {"name": "PLAIN", "value": "plain $(POD)"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
            {
                "name": "FROM_SECRET",
                "valueFrom": {"secretKeyRef": {"name": "s", "key": "password"}},
            },
            {"name": "HOME", "value": "/tmp"},
        ],
        envFrom=[{"configMapRef": {"name": "m"}}],
        volumeMounts=[
            {"name": "cfg", "mountPath": "/etc/cfg"},
            {"name": "sec", "mountPath": "/etc/sec"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        securityContext={
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        resources={"limits": {"cpu": "1", "memory": "256Mi"}, "requests": {"cpu": "100m"}},
    )
    manifest["spec"]["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 2000,
    }
    manifest["spec"]["volumes"] = [
        {"name": "cfg", "configMap": {"name": "m"}},
        {"name": "sec", "secret": {"secretName": "s"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    return manifest


def finished(cluster: Cluster, name: str) -> dict[str, Any] | None:
    found = cluster.get("Pod", name, "default")
    if found and (found.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return found
    return None


def test_a_pod_in_podman_gets_what_its_spec_asks_and_reaches_the_api(
    tmp_path: Path, built: None, swept: None
) -> None:
    options = KubeletOptions(runtime="podman")
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        cluster.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "s", "namespace": "default"},
                "data": {"password": base64.b64encode(b"hunter2").decode()},
            }
        )
        cluster.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "m", "namespace": "default"},
                "data": {"FROM_MAP": "mapped", "greeting": "hello"},
            }
        )
        cluster.create(reporting_pod())
        done = cluster.wait_for(lambda: finished(cluster, "reporter"), "the pod to finish", 120)
        (state,) = done["status"]["containerStatuses"]
        terminated = state["state"]["terminated"]
        assert (terminated["exitCode"], terminated["message"]) == (3, "reported")
        assert state["containerID"].startswith("podman://")
        log = cluster.kubectl("logs", "reporter").stdout  # as a user reads it
        (line,) = [line for line in log.splitlines() if line.startswith("SEEN ")]
        seen = json.loads(line.removeprefix("SEEN "))
        assert (seen["uid"], seen["gid"]) == (65532, 65532)
        assert 2000 in seen["groups"]
        assert (seen["capeff"], seen["nnp"]) == ("0000000000000000", "1")
        assert seen["/written"] == "Read-only file system"
        assert seen["/tmp/written"] == "ok"
        assert seen["/etc/cfg/written"] == "Read-only file system"
        assert (seen["cfg"], seen["secret"]) == ("hello", "hunter2")
        assert seen["env"] == {
            "PLAIN": "plain $(POD)",  # a reference to a later variable stays as written
            "FROM_SECRET": "hunter2",
            "FROM_MAP": "mapped",
            "POD": "reporter",
            "HOME": "/tmp",
        }
        assert seen["pods"] == ["reporter"]  # the service account reached the API over HTTPS


def test_deleting_a_pod_stops_its_container_with_sigterm_and_nothing_outlives_the_cluster(
    tmp_path: Path, built: None, swept: None
) -> None:
    options = KubeletOptions(runtime="podman")
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        cluster.create(pod("waiter", WAITS_FOR_TERM))
        cluster.create(pod("stays", WAITS_FOR_TERM))  # left running: teardown removes it
        cluster.create(pod("no-image", "pass", image="localhost/kvfence-no-such-image:dev"))
        cluster.wait_for(lambda: "waiting" in cluster.pod_log("waiter"), "it to run", 60)
        cluster.kubectl("delete", "pod", "waiter", "--wait=true", "--timeout=60s")
        assert "got SIGTERM" in cluster.pod_log("waiter")
        cluster.wait_for(
            lambda: cluster.require("Pod", "no-image")["status"]["containerStatuses"][0],
            "the image-less pod to say why it waits",
            until=lambda s: s["state"].get("waiting", {}).get("reason") == "ErrImageNeverPull",
        )
