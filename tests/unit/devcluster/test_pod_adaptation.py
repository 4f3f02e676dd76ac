"""What the test kubelet changes in a container's spec before it runs (sandbox.py) and how it
hands volumes over (volumes.py), without a cluster."""

import os
from pathlib import Path

import pytest

from kvfence_devcluster.podman import mount_flags, resource_flags, security_flags
from kvfence_devcluster.sandbox import (
    NotReadyToStart,
    PodSandbox,
    Unsupported,
    _rewrite_flags,
)
from kvfence_devcluster.volumes import materialize_volumes, sync_volume


class Objects:
    def __init__(self, secrets: dict[str, dict[str, bytes]], version: str = "1") -> None:
        self.secrets, self.version = secrets, version

    def config_data(self, kind: str, namespace: str, name: str):
        data = self.secrets.get(name) if kind == "Secret" else None
        return None if data is None else (data, self.version)


def test_listening_urls_and_port_flags_get_the_pods_local_ports():
    ports = {8080: 41000, 9090: 41001}
    argv = [
        "kvfence", "operator", "--liveness=http://0.0.0.0:8080/healthz",
        "--metrics", "http://0.0.0.0:9090/metrics", "--port", "8080", "--host", "0.0.0.0",
        "--upstream=http://10.0.0.5:8080/x", "--other=http://0.0.0.0:7000",
    ]  # fmt: skip
    assert _rewrite_flags(argv, ports) == [
        "kvfence", "operator", "--liveness=http://127.0.0.1:41000/healthz",
        "--metrics", "http://127.0.0.1:41001/metrics", "--port", "41000", "--host", "127.0.0.1",
        "--upstream=http://10.0.0.5:8080/x",  # another host's port is not the pod's
        "--other=http://0.0.0.0:7000",  # not a declared port
    ]  # fmt: skip


def pod(**spec) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u" * 8}, "spec": spec}


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's group to another needs root")
def test_an_fs_group_owns_secret_files_and_empty_dirs_as_the_kubelet_sets_them(tmp_path: Path):
    sandbox = PodSandbox(tmp_path / "pod", fs_group=4242)
    secret = {"name": "token", "secret": {"secretName": "s", "defaultMode": 0o440}}
    spec = pod(volumes=[secret, {"name": "tmp", "emptyDir": {}}])
    materialize_volumes(spec, sandbox, Objects({"s": {"t": b"x"}}), {})
    token = (sandbox.volume_paths["token"] / "t").stat()
    assert (token.st_gid, token.st_mode & 0o777) == (4242, 0o440)
    tmp = sandbox.volume_paths["tmp"].stat()
    assert (tmp.st_gid, tmp.st_mode & 0o7777) == (4242, 0o2777)
    # rewritten when the Secret changes: still the group's
    assert sync_volume(sandbox, secret, "ns", Objects({"s": {"t": b"y"}}, "2"))
    assert (sandbox.volume_paths["token"] / "t").stat().st_gid == 4242


def test_security_context_becomes_podman_flags_the_container_over_the_pod():
    spec = pod(securityContext={"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 7})
    container = {
        "securityContext": {
            "runAsUser": 65532,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        }
    }
    assert security_flags(spec, container) == [
        "--user", "65532:1000", "--group-add", "7", "--read-only", "--read-only-tmpfs=false",
        "--cap-drop=ALL", "--cap-add=NET_BIND_SERVICE", "--security-opt", "no-new-privileges",
    ]  # fmt: skip
    with pytest.raises(NotReadyToStart, match="runAsNonRoot"):
        security_flags(pod(securityContext={"runAsNonRoot": True, "runAsUser": 0}), {})
    with pytest.raises(Unsupported, match="privileged"):
        security_flags(spec, {"securityContext": {"privileged": True}})


def test_resources_become_podman_limits_and_a_gpu_is_refused():
    container = {
        "resources": {"limits": {"cpu": "1500m", "memory": "2Gi"}, "requests": {"cpu": "1"}}
    }
    assert resource_flags(container) == [
        "--cpus", "1.5", "--cpu-shares", "1024", "--memory", str(2 * 1024**3),
    ]  # fmt: skip
    with pytest.raises(Unsupported, match=r"nvidia\.com/gpu"):
        resource_flags({"resources": {"limits": {"nvidia.com/gpu": 1}}})


def test_file_volumes_and_read_only_claims_are_mounted_read_only(tmp_path: Path):
    sandbox = PodSandbox(tmp_path)
    sandbox.volume_paths = {
        "cfg": tmp_path / "cfg",
        "models": tmp_path / "m",
        "tmp": tmp_path / "t",
    }
    spec = pod(
        volumes=[
            {"name": "cfg", "configMap": {"name": "c"}},
            {"name": "models", "persistentVolumeClaim": {"claimName": "m", "readOnly": True}},
            {"name": "tmp", "emptyDir": {}},
        ]
    )
    container = {
        "name": "c",
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/cfg"},
            {"name": "models", "mountPath": "/models"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    flags = mount_flags(spec, container, sandbox, tmp_path / "sa")
    volumes = flags[1::2]
    assert volumes == [
        f"{tmp_path}/cfg:/etc/cfg:ro",
        f"{tmp_path}/m:/models:ro",
        f"{tmp_path}/t:/tmp:rw",
        f"{tmp_path}/termination-log-c:/dev/termination-log:rw",
        f"{tmp_path}/sa:/var/run/secrets/kubernetes.io/serviceaccount:ro",
    ]
