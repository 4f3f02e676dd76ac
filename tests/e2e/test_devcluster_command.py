"""`kvfence-devcluster` (kvfence_devcluster/cli.py): the test cluster as a command that the real
kubectl and the kubernetes client use through the kubeconfig it writes, and that stops every
process it started on SIGTERM or SIGINT."""

import base64
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import openai
import pytest
import urllib3
import yaml
from kubernetes import client, config

from helpers.waits import FACT_S, READY_S, eventually
from helpers.web_pods import pod, service
from kvfence_devcluster.apiserver import INFERENCE_DEPLOYMENT_CRD

REPO = Path(__file__).resolve().parents[2]
PROG = "kvfence-devcluster"
INFD = ("kvfence.dev", "v1alpha1", "default", "inferencedeployments")
USER_KEY = "sk-user-a-0123456789"


class Command:
    """A running `kvfence-devcluster`, started from `launcher` (the argv before its options)."""

    def __init__(self, launcher: list[str], *args: str) -> None:
        self.proc = subprocess.Popen(
            [*launcher, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def next_line(self, timeout: float = READY_S) -> str:
        """The next line it prints (a thread reads them, so none waits in a buffer)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{PROG} printed nothing in {timeout:g}s") from None
        assert line, f"{PROG} exited: {self.proc.wait()} {self.stderr()}"
        return line

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.stderr and self.proc.poll() is not None else ""

    def descendants(self) -> set[tuple[int, str]]:
        """(pid, start time) of every process under it: its pods and the operator."""
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                parents[int(entry.name)] = int(fields[1])
        found, frontier = set(), {self.proc.pid}
        while frontier:
            frontier = {pid for pid, parent in parents.items() if parent in frontier}
            found |= frontier
        return {(pid, start) for pid in found if (start := start_time(pid)) is not None}

    def stop(self, sig: signal.Signals, timeout: float = FACT_S) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def still_running(processes: set[tuple[int, str]]) -> set[tuple[int, str]]:
    return {(pid, start) for pid, start in processes if start_time(pid) == start}


@pytest.fixture
def commands() -> Iterator[list[Command]]:
    started: list[Command] = []
    yield started
    for command in started:  # a failed test leaves nothing running: its pods too
        if command.proc.poll() is None:
            command.proc.terminate()
            try:
                command.proc.wait(30)
            except subprocess.TimeoutExpired:
                command.proc.kill()
                command.proc.wait()


def kubectl(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_command_serves_kubectl_and_services_and_stops_everything_on_sigterm(
    tmp_path, commands
):
    kubeconfig = tmp_path / "kube" / "config"
    command = Command(
        [sys.executable, "-m", "kvfence_devcluster"],
        "--kubeconfig",
        str(kubeconfig),
        "--state-dir",
        str(tmp_path / "state"),
    )
    commands.append(command)
    line = command.next_line()
    assert line.startswith(f"{PROG}: ") and line.rstrip().endswith(
        f"export KUBECONFIG={kubeconfig.resolve()}"
    ), line
    assert kubeconfig.exists(), "written before it says so"

    version = kubectl(kubeconfig, "version")
    assert version.returncode == 0 and "Server Version" in version.stdout, version.stderr
    empty = kubectl(kubeconfig, "get", "pods")
    assert empty.returncode == 0, empty.stderr

    api = config.new_client_from_config(config_file=str(kubeconfig))
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        "default", client.V1Pod.model_validate(pod("hello", {"app": "hello"}))
    )
    created = core.create_namespaced_service(
        "default", client.V1Service.model_validate(service("hello", {"app": "hello"}))
    )
    assert created.spec is not None
    url = f"http://{created.spec.cluster_ip}:8000/"
    assert eventually(
        lambda: httpx.get(url, timeout=2.0).text == "hello", "the Service to answer", 60
    )
    assert [p.metadata and p.metadata.name for p in core.list_namespaced_pod("default").items] == [
        "hello"
    ]
    api.close()

    running = command.descendants()
    assert running, "the pod runs under the command"
    assert command.stop(signal.SIGTERM) == 0, command.stderr()
    assert not still_running(running), "every process it started is stopped"
    assert not kubeconfig.exists(), "a kubeconfig for a stopped server is removed"
    assert (tmp_path / "state" / "cluster" / "logs" / "default_hello_web.log").exists()


def test_a_killed_command_leaves_no_pod_running(tmp_path, commands):
    """SIGKILL gives it no chance to stop its pods: they die with it (the parent-death signal)."""
    kubeconfig = tmp_path / "kubeconfig"
    command = Command([sys.executable, "-m", "kvfence_devcluster"], "--kubeconfig", str(kubeconfig))
    commands.append(command)
    command.next_line()
    api = config.new_client_from_config(config_file=str(kubeconfig))
    client.CoreV1Api(api).create_namespaced_pod(
        "default", client.V1Pod.model_validate(pod("hello", {"app": "hello"}))
    )
    api.close()
    running = eventually(command.descendants, "the pod to run under the command", READY_S)
    command.proc.kill()
    command.proc.wait()
    eventually(lambda: not still_running(running), "the pod's processes to die with it")


@pytest.mark.slow
def test_the_console_script_runs_the_operator_whose_service_answers_and_stops_on_ctrl_c(
    tmp_path, commands
):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts[PROG].split(":")
    entry_point = f"import sys, {module} as m; sys.exit(m.{function}())"
    kubeconfig = tmp_path / "kubeconfig"
    command = Command(
        [sys.executable, "-c", entry_point],
        *("--kubeconfig", str(kubeconfig), "--operator", "--state-dir", str(tmp_path / "state")),
    )
    commands.append(command)
    assert "export KUBECONFIG=" in command.next_line()

    # As a user would: the CRD first (a new cluster has none), then the keys and the example.
    api = config.new_client_from_config(config_file=str(kubeconfig))
    crd = yaml.safe_load(INFERENCE_DEPLOYMENT_CRD.read_text())
    client.ApiextensionsV1Api(api).create_custom_resource_definition(crd)
    assert command.next_line().endswith("the operator is running\n")
    operator = [p for p in command.descendants() if "operator" in cmdline(p[0])]
    assert operator, "the operator runs under the command"
    keys = base64.b64encode(f"{USER_KEY} team-a\n".encode()).decode()
    client.CoreV1Api(api).create_namespaced_secret(
        "default",
        client.V1Secret.model_validate(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "tiny-keys"},
                "data": {"api-keys": keys},
            }
        ),
    )
    tiny = {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "engine": {"kvCacheMemory": "1Mi", "extraArgs": ["--threads", "1"]},
            "contextLength": 1024,
            "prefill": {"resources": {"requests": {"cpu": "1"}}},
            "decode": {"resources": {"requests": {"cpu": "1"}}},
            "router": {"apiKeysSecret": "tiny-keys"},
            "canary": {"enabled": False},  # the command is the subject; canaries have their own
        },
    }
    objects = client.CustomObjectsApi(api)
    objects.create_namespaced_custom_object(*INFD, tiny)

    def ready() -> bool:
        found = objects.get_namespaced_custom_object(*INFD, "tiny")
        assert isinstance(found, dict), found  # a custom resource has no model: its JSON object
        status = found.get("status") or {}
        return any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
        )

    eventually(ready, "the InferenceDeployment to be Ready", timeout=READY_S)
    # Raw JSON: the client's models refuse integer quantities (a real API server would have
    # written them back as strings; this one keeps what it got).
    # (_preload_content=False answers urllib3's response, which the client's hints do not say)
    raw = client.CoreV1Api(api).read_namespaced_service("tiny", "default", _preload_content=False)
    stable = json.loads(cast(urllib3.BaseHTTPResponse, raw).data)["spec"]
    api.close()
    base_url = f"http://{stable['clusterIP']}:{stable['ports'][0]['port']}/v1"
    with openai.OpenAI(base_url=base_url, api_key=USER_KEY, max_retries=0) as router:
        assert [m.id for m in router.models.list()] == ["tiny-random"]

    running = command.descendants()
    assert len(running) > len(operator), "the operator and its pods run under the command"
    assert command.stop(signal.SIGINT) == 0, command.stderr()
    assert not still_running(running), "every process it started is stopped"
    assert not kubeconfig.exists()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def test_a_kubeconfig_it_did_not_write_or_cannot_write_is_one_error_line(tmp_path):
    theirs = tmp_path / "config"
    theirs.write_text(yaml.safe_dump({"clusters": [{"name": "production"}]}))
    before = theirs.read_text()
    result = subprocess.run(
        [sys.executable, "-m", "kvfence_devcluster", "--kubeconfig", str(theirs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "refusing to overwrite" in result.stderr
    assert theirs.read_text() == before

    unwritable = subprocess.run(
        [sys.executable, "-m", "kvfence_devcluster", "--kubeconfig", "/proc/kvfence/config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unwritable.returncode == 1
    assert unwritable.stderr == (
        f"{PROG}: error: cannot write the kubeconfig /proc/kvfence/config: "
        "No such file or directory\n"
    )

    helped = subprocess.run(
        [sys.executable, "-m", "kvfence_devcluster", "--help"], capture_output=True, text=True
    )
    assert helped.returncode == 0 and "exit codes:" in helped.stdout
