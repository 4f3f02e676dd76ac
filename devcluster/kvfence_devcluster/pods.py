"""One pod's life on the test kubelet: admit it (ports, pod IP, volumes), run a process per
container, restart per restartPolicy with back-off, probe readiness, and write the pod's status
as the real kubelet computes it."""

import asyncio
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .controllers import set_condition
from .options import KubeletOptions
from .processes import ManagedProcess
from .resources import ResourceType, now_rfc3339
from .runtime import ContainerRuntime
from .sandbox import (
    POD_IP,
    NotReadyToStart,
    ObjectLookup,
    PodSandbox,
    Unsupported,
    allocate_ports,
)
from .store import FULL, Store
from .volumes import materialize_volumes

TERMINATION_MESSAGE_LIMIT = 4096  # bytes, as in Kubernetes
KUBELET_CONDITIONS = (
    "PodScheduled",
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
)


class Node(ObjectLookup, Protocol):
    """What a pod's runtime needs of the kubelet that runs it (kubelet.Kubelet)."""

    options: KubeletOptions
    store: Store
    pods: ResourceType
    pods_dir: Path
    logs_dir: Path
    errors: list[str]
    ports_given: set[int]
    processes: list[ManagedProcess]
    runtime: ContainerRuntime

    def resync_volumes(self, runtime: "PodRuntime") -> bool | None: ...

    async def probe(
        self, runtime: "PodRuntime", container: "Container", kind: str = "readinessProbe"
    ) -> bool: ...


@dataclass
class Container:
    spec: dict[str, Any]
    process: ManagedProcess | None = None
    restarts: int = 0
    ready: bool = False
    probe_failures: int = 0
    live_failures: int = 0
    next_liveness: float = 0.0  # when the liveness probe runs next (time.monotonic())
    state: dict[str, Any] = field(
        default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}}
    )
    last_state: dict[str, Any] = field(default_factory=dict)
    restart_at: float | None = None
    finished: bool = False  # terminated and will not restart

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def status(self) -> dict[str, Any]:
        running = "running" in self.state
        status = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": running,
            "restartCount": self.restarts,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.process is not None and self.process.popen is not None:
            status["containerID"] = self.process.container_id
        return status


def pre_stop_sleep(container: dict[str, Any]) -> float:
    """Seconds of the container's `lifecycle.preStop.sleep` (the only preStop action run; an
    exec or httpGet hook is not, as if it returned at once)."""
    sleep = ((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
    return float(sleep.get("seconds") or 0)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N: 128+N, as container runtimes say


class PodRuntime:
    def __init__(self, kubelet: Node, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.kubelet = kubelet
        self.uid, self.namespace, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.sandbox = PodSandbox(
            kubelet.pods_dir / f"{self.namespace}_{self.name}_{self.uid[:8]}",
            fs_group=(pod["spec"].get("securityContext") or {}).get("fsGroup"),
        )
        self.containers = [Container(c) for c in pod["spec"].get("containers") or []]
        self.restart_policy = pod["spec"].get("restartPolicy", "Always")
        self.grace = min(
            float(pod["spec"].get("terminationGracePeriodSeconds", 30)), kubelet.options.grace_cap
        )
        self.task: asyncio.Task[None] | None = None
        self._deadline = float("inf")  # of the grace period, once terminating
        self._hurried = False  # at teardown: no preStop sleep (nobody is left to drain for)

    @property
    def store(self) -> Store:
        return self.kubelet.store

    def log_path(self, container: str) -> Path:
        return self.kubelet.logs_dir / f"{self.namespace}_{self.name}_{container}.log"

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"pod {self.namespace}/{self.name}")

    async def _run(self) -> None:
        try:
            if not await self._admit():
                return
            while True:
                for container in self.containers:
                    await self._step(container)
                if self.kubelet.resync_volumes(self) is None:
                    return
                if self._write_status() is None:
                    return  # the pod is gone; the kubelet stops us
                if all(c.finished for c in self.containers):
                    return
                await asyncio.sleep(self.kubelet.options.probe_period)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.kubelet.errors.append(
                f"pod {self.namespace}/{self.name}: {traceback.format_exc()}"
            )
            raise

    async def _admit(self) -> bool:
        """Scheduled to our node with a pod IP and local ports; then volumes (retried until the
        Secrets and ConfigMaps exist, as the kubelet keeps a pod in ContainerCreating)."""
        self.sandbox.root.mkdir(parents=True, exist_ok=True)
        node = self.kubelet.options.node_name

        def admit(pod: dict[str, Any]) -> None:
            allocate_ports(pod, self.sandbox, self.kubelet.ports_given)
            pod["spec"]["nodeName"] = node
            status = pod.setdefault("status", {})
            status.update(
                phase="Pending",
                hostIP=POD_IP,
                hostIPs=[{"ip": POD_IP}],
                podIP=POD_IP,
                podIPs=[{"ip": POD_IP}],
                startTime=now_rfc3339(),
            )

        if self.store.update(self.kubelet.pods, self.namespace, self.name, admit, FULL) is None:
            return False
        while True:
            try:
                pod = self.store.get(self.kubelet.pods, self.namespace, self.name)
                if pod["spec"].get("initContainers"):
                    raise Unsupported("initContainers are not run by the test kubelet")
                materialize_volumes(pod, self.sandbox, self.kubelet, self.kubelet.options.claims)
                return True
            except (NotReadyToStart, Unsupported) as exc:
                reason = exc.reason if isinstance(exc, NotReadyToStart) else "ContainerCreating"
                for container in self.containers:
                    container.state = {"waiting": {"reason": reason, "message": str(exc)}}
                if self._write_status() is None:
                    return False
            await asyncio.sleep(self.kubelet.options.probe_period * 4)

    def _start(self, container: Container, pod: dict[str, Any]) -> None:
        log_path = self.log_path(container.name)
        termination_log = self.sandbox.termination_log(container.name)
        termination_log.write_bytes(b"")
        termination_log.chmod(0o666)  # the container's user writes it, whoever that is
        try:
            created = self.kubelet.runtime.create(pod, container.spec, self.sandbox, log_path)
        except (NotReadyToStart, Unsupported) as exc:
            reason = (
                exc.reason if isinstance(exc, NotReadyToStart) else "CreateContainerConfigError"
            )
            container.state = {"waiting": {"reason": reason, "message": str(exc)}}
            container.restart_at = time.monotonic() + self.kubelet.options.probe_period * 4
            return
        if created.notes:
            with open(log_path, "a") as log:
                log.writelines(f"[kubelet] {note}\n" for note in created.notes)
        container.process = created.process
        self.kubelet.processes.append(container.process)
        container.probe_failures, container.ready, container.restart_at = 0, False, None
        container.live_failures = 0
        liveness = container.spec.get("livenessProbe") or {}
        container.next_liveness = time.monotonic() + float(liveness.get("initialDelaySeconds", 0))
        try:
            container.process.start()
        except OSError as exc:  # no such executable: what container runtimes call StartError
            container.process = None
            self._terminated(container, 128, "StartError", str(exc), now_rfc3339())
            return
        container.state = {"running": {"startedAt": now_rfc3339()}}

    def _termination_message(self, container: Container, code: int) -> str:
        message = self.sandbox.termination_log(container.name).read_bytes()[
            :TERMINATION_MESSAGE_LIMIT
        ]
        text = message.decode(errors="replace")
        if (
            not text.strip()
            and code
            and container.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        ):
            lines = self.log_path(container.name).read_text(errors="replace").splitlines()[-80:]
            text = "\n".join(lines)[-2048:]
        return text

    def _terminated(
        self, container: Container, code: int, reason: str, message: str, started: str
    ) -> None:
        terminated = {
            "exitCode": code,
            "reason": reason,
            "startedAt": started,
            "finishedAt": now_rfc3339(),
        }
        if message:
            terminated["message"] = message
        restart = self.restart_policy == "Always" or (
            self.restart_policy == "OnFailure" and code != 0
        )
        container.ready = False
        if not restart:
            container.state, container.finished = {"terminated": terminated}, True
            return
        options = self.kubelet.options
        delay = min(options.restart_backoff * 2**container.restarts, options.max_restart_backoff)
        container.last_state = {"terminated": terminated}
        container.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={container.name} "
                f"pod={self.name}_{self.namespace}({self.uid})",
            }
        }
        container.restart_at = time.monotonic() + delay

    async def _step(self, container: Container) -> None:
        if container.finished:
            return
        if container.process is None or container.restart_at is not None:
            if container.restart_at is None or time.monotonic() >= container.restart_at:
                if container.state.get("waiting", {}).get("reason") == "CrashLoopBackOff":
                    container.restarts += 1
                pod = self.store.find(self.kubelet.pods, self.namespace, self.name)
                if pod is not None:
                    self._start(container, pod)
            return
        code = container.process.poll()
        if code is not None:
            started = container.state.get("running", {}).get("startedAt", now_rfc3339())
            code = _exit_code(code)
            self._terminated(
                container,
                code,
                "Completed" if code == 0 else "Error",
                self._termination_message(container, code),
                started,
            )
            return
        if await self._unhealthy(container):
            return
        succeeded = await self.kubelet.probe(self, container)
        threshold = int((container.spec.get("readinessProbe") or {}).get("failureThreshold", 3))
        container.probe_failures = 0 if succeeded else container.probe_failures + 1
        if succeeded:
            container.ready = True
        elif container.probe_failures >= threshold:
            container.ready = False

    async def _unhealthy(self, container: Container) -> bool:
        """The liveness probe, on its own schedule (initialDelaySeconds, periodSeconds,
        timeoutSeconds, failureThreshold: the spec's seconds, not the test kubelet's faster
        readiness period). Once it failed failureThreshold times in a row, the container is
        stopped as for a deletion (its preStop sleep, SIGTERM, SIGKILL once the grace period is
        over) and restarted per restartPolicy; True then."""
        liveness = container.spec.get("livenessProbe")
        if not liveness or time.monotonic() < container.next_liveness:
            return False
        container.next_liveness = time.monotonic() + float(liveness.get("periodSeconds", 10))
        if await self.kubelet.probe(self, container, "livenessProbe"):
            container.live_failures = 0
            return False
        container.live_failures += 1
        if container.live_failures < int(liveness.get("failureThreshold", 3)):
            return False
        assert container.process is not None
        with open(self.log_path(container.name), "a") as log:
            log.write(
                f"[kubelet] liveness probe failed {container.live_failures} times in a row: "
                "stopping the container (it restarts per restartPolicy)\n"
            )
        started = container.state.get("running", {}).get("startedAt", now_rfc3339())
        pre_stop = min(pre_stop_sleep(container.spec), self.grace)
        await asyncio.sleep(pre_stop)
        code = _exit_code(await container.process.astop(grace=max(self.grace - pre_stop, 2.0)) or 0)
        reason = "Completed" if code == 0 else "Error"
        self._terminated(
            container, code, reason, self._termination_message(container, code), started
        )
        return True

    def _phase(self) -> str:
        if self.containers and all(c.finished for c in self.containers):
            codes = [c.state["terminated"]["exitCode"] for c in self.containers]
            return "Succeeded" if not any(codes) else "Failed"
        if any(c.process is not None for c in self.containers):
            return "Running"
        return "Pending"

    def _write_status(self) -> dict[str, Any] | None:
        phase = self._phase()
        statuses = [c.status() for c in self.containers]

        def update(pod: dict[str, Any]) -> None:
            status = pod.setdefault("status", {})
            if status.get("reason") == "Evicted":
                return  # evicted: the kubelet stops this runtime; the phase stays Failed
            status.update(phase=phase, containerStatuses=statuses)
            status["conditions"] = self._conditions(pod, phase)

        return self.store.update(self.kubelet.pods, self.namespace, self.name, update, "status")

    def _conditions(self, pod: dict[str, Any], phase: str) -> list[dict[str, Any]]:
        conditions = list((pod.get("status") or {}).get("conditions") or [])
        unready = [c.name for c in self.containers if not c.ready]
        started = any(c.process is not None for c in self.containers)

        def put(kind: str, ok: bool, reason: str | None = None, message: str | None = None) -> None:
            nonlocal conditions
            extra = {} if ok else {"reason": reason or "", "message": message or ""}
            conditions = set_condition(
                conditions, kind, "True" if ok else "False", lastProbeTime=None, **extra
            )

        put("PodScheduled", True)
        put("PodReadyToStartContainers", True)
        put("Initialized", True)
        if phase in ("Succeeded", "Failed"):
            put("ContainersReady", False, "PodCompleted", "")
            put("Ready", False, "PodCompleted", "")
        elif unready or not started:
            message = f"containers with unready status: [{' '.join(unready)}]"
            put("ContainersReady", False, "ContainersNotReady", message)
            put("Ready", False, "ContainersNotReady", message)
        else:
            put("ContainersReady", True)
            gates = []
            for gate in pod["spec"].get("readinessGates") or []:
                kind = gate["conditionType"]
                found = next((c for c in conditions if c.get("type") == kind), None)
                if found is None:
                    gates.append(
                        f'corresponding condition of pod readiness gate "{kind}" does not exist.'
                    )
                elif found.get("status") != "True":
                    gates.append(
                        f'the status of pod readiness gate "{kind}" is not "True", '
                        f"but {found.get('status')}"
                    )
            put("Ready", not gates, "ReadinessGatesNotReady", ", ".join(gates))
        order = {kind: n for n, kind in enumerate(KUBELET_CONDITIONS)}
        return sorted(conditions, key=lambda c: order.get(c.get("type", ""), len(order)))

    async def terminate(self) -> None:
        """Stop the containers as the kubelet does, then drop the directory: each container's
        preStop sleep (the pod is already out of every Service's endpoints: it is gone from
        the store), then SIGTERM, then SIGKILL once the grace period, counted from the start,
        has passed (2 s after a preStop that used it all up, as the kubelet allows)."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self._deadline = time.monotonic() + self.grace
        await asyncio.gather(
            *(self._stop(c, c.process) for c in self.containers if c.process is not None)
        )
        self.sandbox.remove()

    async def _stop(self, container: Container, process: ManagedProcess) -> None:
        pre_stop = time.monotonic() + pre_stop_sleep(container.spec)
        while (
            time.monotonic() < min(pre_stop, self._deadline)
            and process.running
            and not self._hurried
        ):
            await asyncio.sleep(0.05)
        at_least = time.monotonic() + 2.0
        await process.astop(until=lambda: max(self._deadline, at_least))

    def hurry(self, grace: float) -> None:
        """At teardown: end any preStop sleep at once (SIGTERM now) and cut the grace period
        still running to `grace` seconds."""
        self._hurried = True
        self.grace = min(self.grace, grace)
        self._deadline = min(self._deadline, time.monotonic() + grace)
