"""How the test kubelet turns a pod's container into something running: the runtime interface
pods.py starts containers through, and the default runtime, which runs each container as a
process on this machine (podman.py runs them as containers of their images)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .hollow import HOLLOW, hollow_argv
from .options import KubeletOptions
from .processes import ManagedProcess
from .sandbox import ObjectLookup, PodSandbox, container_launch


class Host(ObjectLookup, Protocol):
    """What a runtime needs of the kubelet (kubelet.Kubelet)."""

    options: KubeletOptions

    def base_env(self) -> dict[str, str]: ...

    def pod_env(self) -> dict[str, str]: ...

    def resolve_service(self, namespace: str, service: str, port: int | None) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Created:
    process: ManagedProcess  # not started yet
    notes: list[str]  # what the kubelet could not do or did instead, for the container's log


class ContainerRuntime(Protocol):
    def create(
        self, pod: dict[str, Any], container: dict[str, Any], sandbox: PodSandbox, log: Path
    ) -> Created:
        """The container, ready to start; raises sandbox.NotReadyToStart (retried later) or
        sandbox.Unsupported (the pod stays Pending)."""
        ...

    def sweep(self) -> None:
        """Remove whatever this runtime started that may outlive its processes (teardown)."""
        ...


class ProcessRuntime:
    """Each container a process here: the pod's volumes are folders, and its paths and its
    image's commands are mapped to this machine's (sandbox.container_launch)."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def create(
        self, pod: dict[str, Any], container: dict[str, Any], sandbox: PodSandbox, log: Path
    ) -> Created:
        options = self.host.options
        launch = container_launch(
            pod,
            container,
            sandbox,
            self.host,
            self.host.resolve_service,
            self.host.base_env(),
            list(options.default_command),
        )
        argv = options.amend_argv(pod, launch.argv) if options.amend_argv else launch.argv
        notes = list(launch.notes)
        if options.hollow and hollow_argv(argv) != argv:
            argv = hollow_argv(argv)
            notes.append(f"a {HOLLOW}: {' '.join(argv[:3])} runs instead of kvfence")
        return Created(ManagedProcess(argv, log, launch.env, launch.cwd), notes)

    def sweep(self) -> None:
        """Nothing: a process dies with its group (ManagedProcess)."""
