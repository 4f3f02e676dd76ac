"""The podman runtime of the test kubelet (`kvfence-devcluster --runtime podman`): each
container runs in its image, as a pod on a real node would.

What a pod's spec asks, podman is told: the image (never pulled: it must be on this machine),
command and args (over the image's ENTRYPOINT and CMD, with `$(VAR)` expanded), env and
envFrom, workingDir, every volumeMount (the pod's volumes are folders here, volumes.py;
configMap, secret and projected ones read-only), the termination message file, the service
account folder with a token and the cluster's CA (in_cluster.py), securityContext (runAsUser,
runAsGroup, runAsNonRoot, fsGroup and supplementalGroups, readOnlyRootFilesystem with no tmpfs
added, capabilities, allowPrivilegeEscalation, seccomp) and resource limits. Probes, preStop
sleeps, grace periods and restarts are the kubelet's, as for processes.

Networking stays the process runtime's: each container shares this machine's network, and its
declared ports are mapped to free local ones in its flags (sandbox.py), so Services, the
kube-proxy and the pods' addresses behave the same under both runtimes. Service names in env,
command and args are resolved as for processes.

Every container carries LABEL (this cluster's id) and OWNER_LABEL (the pid of the process that
runs the cluster): teardown removes the cluster's containers, and a cluster starting removes
those of clusters whose process died (podman's conmon outlives a killed parent).
"""

import json
import os
import subprocess
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.utils import parse_quantity

from .in_cluster import SERVICE_ACCOUNT_DIR, InClusterAccess
from .processes import ManagedProcess
from .runtime import Created, Host
from .sandbox import TERMINATION_LOG, NotReadyToStart, PodSandbox, Unsupported, adapt_spec
from .volumes import FILE_VOLUMES

LABEL = "kvfence.dev/devcluster"
OWNER_LABEL = "kvfence.dev/devcluster-pid"
NAME_PREFIX = "kvf-"  # every container's name: kvf-<pod uid>-<container>-<start>
PODMAN_TIMEOUT_S = 60.0


def podman(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    """One podman command, with this process's environment (its storage and configuration:
    images/podman-env.sh)."""
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=PODMAN_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass
class PodmanContainer(ManagedProcess):
    """`podman run` attached (its output is the container's log, its exit code the
    container's); signals go to the container by name, not to the podman client, and a kill
    removes the container, so none outlives its process."""

    container: str = ""
    _signals: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)

    @property
    def container_id(self) -> str:
        return f"podman://{self.container}"

    def poll(self) -> int | None:
        """The container's exit code once `podman run` returned it. Unlike a process group,
        nothing of a container outlives it, so there is nothing to kill after its exit."""
        return None if self.popen is None else self.popen.poll()

    def _signal_group(self, sig: int) -> None:
        if self.popen is None or self.popen.returncode is not None:
            return
        self._signals = [p for p in self._signals if p.poll() is None]
        self._signals.append(  # not waited for: this runs on the kubelet's event loop
            subprocess.Popen(
                ["podman", "kill", "--signal", str(int(sig)), self.container],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

    def kill(self) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            podman("rm", "--force", "--ignore", "--time", "0", self.container)
        for signal_sent in self._signals:
            signal_sent.wait()
        return self.popen.wait(timeout=PODMAN_TIMEOUT_S)


def _quantity(value: Any) -> float:
    return float(parse_quantity(str(value)))


def resource_flags(container: Mapping[str, Any]) -> list[str]:
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    flags = []
    for name in {**limits, **requests}:
        if name not in ("cpu", "memory", "ephemeral-storage"):
            raise Unsupported(f"resource {name!r} is not available to podman containers here")
    if "cpu" in limits:
        flags += ["--cpus", f"{_quantity(limits['cpu']):g}"]
    if "cpu" in requests:  # cgroup cpu weight, as the kubelet derives it from the request
        flags += ["--cpu-shares", str(max(2, int(_quantity(requests["cpu"]) * 1024)))]
    if "memory" in limits:
        flags += ["--memory", str(int(_quantity(limits["memory"])))]
    return flags


def security_flags(pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    """securityContext as the kubelet applies it: the container's fields over the pod's."""
    pod_context = pod["spec"].get("securityContext") or {}
    context = container.get("securityContext") or {}

    def setting(key: str) -> Any:
        return context.get(key, pod_context.get(key))

    if context.get("privileged"):
        raise Unsupported("privileged containers are not run by the test kubelet")
    user, group = setting("runAsUser"), setting("runAsGroup")
    if setting("runAsNonRoot") and user in (None, 0):
        # the real kubelet also reads the image's USER; these tests always name the uid
        raise NotReadyToStart(
            "CreateContainerConfigError",
            "container has runAsNonRoot and image will run as root"
            if user == 0
            else "runAsNonRoot without runAsUser is not checked against the image here",
        )
    flags = []
    if user is not None:
        flags += ["--user", f"{user}:{group}" if group is not None else str(user)]
    for extra in [pod_context.get("fsGroup"), *(pod_context.get("supplementalGroups") or [])]:
        if extra is not None:
            flags += ["--group-add", str(extra)]
    if context.get("readOnlyRootFilesystem"):
        flags += ["--read-only", "--read-only-tmpfs=false"]  # no /tmp the pod did not mount
    capabilities = context.get("capabilities") or {}
    flags += [f"--cap-drop={c}" for c in capabilities.get("drop") or []]
    flags += [f"--cap-add={c}" for c in capabilities.get("add") or []]
    if context.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    seccomp = (setting("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        flags += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":
        raise Unsupported(f"seccompProfile {seccomp!r} is not run by the test kubelet")
    return flags


def mount_flags(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    sandbox: PodSandbox,
    service_account: Path | None,
) -> list[str]:
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    flags = []
    targets = set()
    for mount in container.get("volumeMounts") or []:
        name = mount["name"]
        if name not in sandbox.volume_paths:
            raise Unsupported(f"volumeMount {name!r} names no volume of the pod")
        volume = volumes.get(name, {})
        source = sandbox.volume_paths[name] / mount.get("subPath", "")
        read_only = (
            bool(mount.get("readOnly"))
            or any(kind in volume for kind in FILE_VOLUMES)
            or bool((volume.get("persistentVolumeClaim") or {}).get("readOnly"))
        )
        flags += ["--volume", f"{source}:{mount['mountPath']}:{'ro' if read_only else 'rw'}"]
        targets.add(mount["mountPath"].rstrip("/"))
    termination = container.get("terminationMessagePath") or TERMINATION_LOG
    flags += ["--volume", f"{sandbox.termination_log(container['name'])}:{termination}:rw"]
    if service_account is not None and SERVICE_ACCOUNT_DIR not in targets:
        flags += ["--volume", f"{service_account}:{SERVICE_ACCOUNT_DIR}:ro"]
    return flags


class PodmanRuntime:
    def __init__(self, host: Host, access: InClusterAccess) -> None:
        self.host, self.access = host, access
        self.cluster = uuid.uuid4().hex[:12]
        self._started = 0
        self._images: set[str] = set()  # found on this machine
        sweep_orphans()

    def create(
        self, pod: dict[str, Any], container: dict[str, Any], sandbox: PodSandbox, log: Path
    ) -> Created:
        image = str(container.get("image") or "")
        if image not in self._images:
            if not image or podman("image", "exists", image).returncode != 0:
                raise NotReadyToStart(
                    "ErrImageNeverPull",
                    f'Container image "{image}" is not present with pull policy of Never '
                    "(the test kubelet pulls nothing: build or load it first)",
                )
            self._images.add(image)
        meta = pod["metadata"]
        spec = adapt_spec(pod, container, sandbox, self.host, self.host.resolve_service)
        if self.host.options.amend_argv is not None:  # the whole command line, as for processes
            argv = self.host.options.amend_argv(
                pod, [*(spec.command or self.host.options.default_command), *spec.args]
            )
            command: list[str] | None = argv[:1]
            args = argv[1:]
        else:
            command, args = spec.command, spec.args
        service_account = None
        if pod["spec"].get("automountServiceAccountToken") is not False:
            service_account = self.access.write_service_account(
                sandbox.root / "serviceaccount", meta["namespace"]
            )
        self._started += 1
        name = f"{NAME_PREFIX}{meta['uid'][:8]}-{container['name']}-{self._started}"
        env = {**self.host.pod_env(), **self.access.env(), **spec.env}
        # Values travel in podman's environment (`--env NAME`), not its argv, where any user
        # of this machine could read a Secret's; names podman itself reads go in the argv.
        inline = {k: v for k, v in env.items() if k in os.environ}
        client_env = {**os.environ, **{k: v for k, v in env.items() if k not in inline}}
        argv = [
            "podman", "run", "--rm", "--name", name, "--pull=never", "--network=host",
            "--sig-proxy=false", "--init=false",
            "--label", f"{LABEL}={self.cluster}", "--label", f"{OWNER_LABEL}={os.getpid()}",
            "--label", f"io.kubernetes.pod.namespace={meta['namespace']}",
            "--label", f"io.kubernetes.pod.name={meta['name']}",
            "--label", f"io.kubernetes.container.name={container['name']}",
            *mount_flags(pod, container, sandbox, service_account),
            *security_flags(pod, container),
            *resource_flags(container),
            *(f"--env={k}" for k in env if k not in inline),
            *(f"--env={k}={v}" for k, v in inline.items()),
        ]  # fmt: skip
        if container.get("workingDir"):
            argv.append(f"--workdir={container['workingDir']}")
        if command is not None:
            argv.append(f"--entrypoint={json.dumps(command)}")
        process = PodmanContainer([*argv, image, *args], log, client_env, sandbox.root)
        process.container = name
        return Created(process, spec.notes)

    def sweep(self) -> None:
        podman("rm", "--force", "--time", "0", "--filter", f"label={LABEL}={self.cluster}")


def sweep_orphans() -> None:
    """Remove the containers of test clusters whose process is gone."""
    listed = podman(
        "ps", "--all", "--filter", f"label={LABEL}", "--format",
        f'{{{{.ID}}}} {{{{index .Labels "{OWNER_LABEL}"}}}}',
    )  # fmt: skip
    orphans = []
    for line in listed.stdout.splitlines():
        container, _, owner = line.partition(" ")
        if not owner.isdigit() or not Path(f"/proc/{owner}").exists():
            orphans.append(container)
    if orphans:
        podman("rm", "--force", "--time", "0", *orphans)
