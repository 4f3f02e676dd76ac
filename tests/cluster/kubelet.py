"""A kubelet for tests: every Pod in the store becomes local processes.

One asyncio task per pod, on the API server's event loop (so its status writes never race
with a request): admit the pod (ports, pod IP, volumes), start one process per container,
then every `probe_period` check exits, restart per restartPolicy with back-off, probe
readiness, keep configMap/secret files in sync, and write the pod's status. The conditions it
owns are PodScheduled, PodReadyToStartContainers, Initialized, ContainersReady and Ready; Ready
also needs every spec.readinessGates condition True, and conditions written by others (the
operator's kvfence.dev/kv-pool) are left as they are.
"""

import asyncio
import base64
import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .controllers import Controllers, pod_ready, set_condition
from .processes import ManagedProcess
from .sandbox import (
    FILE_VOLUMES,
    POD_IP,
    NotReadyToStart,
    PodSandbox,
    Unsupported,
    allocate_ports,
    container_launch,
    materialize_volumes,
    named_port,
    sync_volume,
)
from .selectors import selector_from_label_selector
from .store import FULL, ResourceType, Store, now_rfc3339

logger = logging.getLogger(__name__)
TERMINATION_MESSAGE_LIMIT = 4096  # bytes, as in Kubernetes
KUBELET_CONDITIONS = (
    "PodScheduled",
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
)


def _default_env() -> dict[str, str]:
    """One torch thread per engine (several share two cores), and the machine's kvfence cache:
    a pod's HOME is fresh, and a cold tokenizer cache costs each engine seconds at start."""
    cache = os.environ.get("KVFENCE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvfence"
    )
    return {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "KVFENCE_CACHE_DIR": cache}


@dataclass
class KubeletOptions:
    allow_unsafe: bool = True  # KVFENCE_ALLOW_UNSAFE=1, so tests can deploy --unsafe-fault
    extra_env: Mapping[str, str] = field(default_factory=_default_env)
    probe_period: float = 0.25  # seconds between readiness probes (instead of periodSeconds)
    restart_backoff: float = 0.5  # first restart delay; doubles up to max_restart_backoff
    max_restart_backoff: float = 8.0
    grace_cap: float = 5.0  # terminationGracePeriodSeconds is capped at this
    tick: float = 0.2  # controllers run at least this often (Job deadlines)
    claims: Mapping[str, Path] = field(default_factory=dict)  # PVC name -> local directory
    node_name: str = "kvfence-test-node"
    default_command: tuple[str, ...] = ("kvfence",)  # for containers without `command`


@dataclass
class Container:
    spec: dict[str, Any]
    process: ManagedProcess | None = None
    restarts: int = 0
    ready: bool = False
    probe_failures: int = 0
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
            status["containerID"] = f"kvfence-test://{self.process.pid}"
        return status


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N: 128+N, as container runtimes say


class PodRuntime:
    def __init__(self, kubelet: "Kubelet", pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.kubelet = kubelet
        self.uid, self.namespace, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.sandbox = PodSandbox(kubelet.pods_dir / f"{self.namespace}_{self.name}_{self.uid[:8]}")
        self.containers = [Container(c) for c in pod["spec"].get("containers") or []]
        self.restart_policy = pod["spec"].get("restartPolicy", "Always")
        self.grace = min(
            float(pod["spec"].get("terminationGracePeriodSeconds", 30)), kubelet.options.grace_cap
        )
        self.task: asyncio.Task[None] | None = None

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
            allocate_ports(pod, self.sandbox)
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
        try:
            launch = container_launch(
                pod,
                container.spec,
                self.sandbox,
                self.kubelet,
                self.kubelet.resolve_service,
                self.kubelet.base_env(),
                list(self.kubelet.options.default_command),
            )
        except (NotReadyToStart, Unsupported) as exc:
            reason = (
                exc.reason if isinstance(exc, NotReadyToStart) else "CreateContainerConfigError"
            )
            container.state = {"waiting": {"reason": reason, "message": str(exc)}}
            container.restart_at = time.monotonic() + self.kubelet.options.probe_period * 4
            return
        log_path = self.log_path(container.name)
        if launch.notes:
            with open(log_path, "a") as log:
                log.writelines(f"[kubelet] {note}\n" for note in launch.notes)
        self.sandbox.termination_log(container.name).write_bytes(b"")
        container.process = ManagedProcess(launch.argv, log_path, launch.env, launch.cwd)
        container.probe_failures, container.ready, container.restart_at = 0, False, None
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
        succeeded = await self.kubelet.probe(self, container)
        threshold = int((container.spec.get("readinessProbe") or {}).get("failureThreshold", 3))
        container.probe_failures = 0 if succeeded else container.probe_failures + 1
        if succeeded:
            container.ready = True
        elif container.probe_failures >= threshold or not container.ready:
            container.ready = False

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
        """Kill the containers (SIGTERM, SIGKILL after the grace period), drop the directory."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await asyncio.gather(
            *(c.process.astop(self.grace) for c in self.containers if c.process is not None)
        )
        self.sandbox.remove()


class Kubelet:
    def __init__(
        self,
        store: Store,
        resource_type: Callable[[str, str, str], ResourceType],
        workdir: Path,
        options: KubeletOptions | None = None,
    ) -> None:
        self.store = store
        self.options = options or KubeletOptions()
        self.pods_dir, self.logs_dir = workdir / "pods", workdir / "logs"
        self.pods = resource_type("", "v1", "pods")
        self.services = resource_type("", "v1", "services")
        self.configmaps = resource_type("", "v1", "configmaps")
        self.secrets = resource_type("", "v1", "secrets")
        self.controllers = Controllers(store, resource_type)
        self.runtimes: dict[str, PodRuntime] = {}
        self.errors: list[str] = []
        self._terminating: set[asyncio.Task[None]] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._wake = asyncio.Event()
        self._http = aiohttp.ClientSession()
        self.store.subscribe(lambda _change: self._wake.set() if self._wake else None)
        self._task = asyncio.create_task(self._loop(), name="test kubelet")

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                self.reconcile()
            except Exception:
                self.errors.append(traceback.format_exc())
                logger.exception("test kubelet: reconcile failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.options.tick)
            await asyncio.sleep(0.01)  # let a burst of writes settle into one pass

    def reconcile(self) -> None:
        self.controllers.reconcile()
        pods = {p["metadata"]["uid"]: p for p in self.store.list_objects(self.pods)}
        for uid, runtime in list(self.runtimes.items()):
            pod = pods.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                del self.runtimes[uid]
                task = asyncio.create_task(runtime.terminate())
                self._terminating.add(task)
                task.add_done_callback(self._terminating.discard)
        for uid, pod in pods.items():
            done = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            if (
                uid not in self.runtimes
                and not done
                and not pod["metadata"].get("deletionTimestamp")
            ):
                self.runtimes[uid] = runtime = PodRuntime(self, pod)
                runtime.start()

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        runtimes, self.runtimes = list(self.runtimes.values()), {}
        for runtime in runtimes:
            runtime.grace = min(runtime.grace, 2.0)
        await asyncio.gather(
            *(r.terminate() for r in runtimes), *self._terminating, return_exceptions=True
        )
        if self._http is not None:
            await self._http.close()

    # ---- what pods need -----------------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        """The machine's environment minus anything that points at the test cluster."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("KUBECONFIG", "HOME") and not k.startswith("KUBERNETES_")
        }
        if self.options.allow_unsafe:
            env["KVFENCE_ALLOW_UNSAFE"] = "1"
        env.update(self.options.extra_env)
        return env

    def config_data(
        self, kind: str, namespace: str, name: str
    ) -> tuple[dict[str, bytes], str] | None:
        rt = self.secrets if kind == "Secret" else self.configmaps
        obj = self.store.find(rt, namespace, name)
        if obj is None:
            return None
        if kind == "Secret":
            data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        else:
            data = {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
            data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data, obj["metadata"]["resourceVersion"]

    def resync_volumes(self, runtime: PodRuntime) -> bool | None:
        """Rewrite configMap/secret files whose objects changed (None if the pod is gone)."""
        pod = self.store.find(self.pods, runtime.namespace, runtime.name)
        if pod is None:
            return None
        changed = False
        for volume in pod["spec"].get("volumes") or []:
            if (
                any(kind in volume for kind in FILE_VOLUMES)
                and volume["name"] in runtime.sandbox.volume_paths
            ):
                # A source that disappeared leaves the last files, as in Kubernetes.
                with contextlib.suppress(NotReadyToStart):
                    changed |= sync_volume(runtime.sandbox, volume, runtime.namespace, self)
        return changed

    def resolve_service(self, namespace: str, service: str, port: int | None) -> int | None:
        """The local port of a Ready pod behind `<service>.<namespace>.svc[:port]`."""
        svc = self.store.find(self.services, namespace, service)
        if svc is None or not svc["spec"].get("selector"):
            return None
        ports = svc["spec"].get("ports") or []
        chosen = next((p for p in ports if port is None or int(p["port"]) == port), None)
        if chosen is None:
            return None
        target = chosen.get("targetPort", chosen["port"])
        selector = selector_from_label_selector({"matchLabels": svc["spec"]["selector"]})
        for pod in self.store.list_objects(self.pods, namespace, selector):
            if not pod_ready(pod) and not svc["spec"].get("publishNotReadyAddresses"):
                continue
            runtime = self.runtimes.get(pod["metadata"]["uid"])
            local = named_port(pod, target, runtime.sandbox.port_map if runtime else None)
            if local is not None:
                return local
        return None

    async def probe(self, runtime: PodRuntime, container: Container) -> bool:
        """The readiness probe, as often as probe_period. No probe: ready once running."""
        probe = container.spec.get("readinessProbe")
        if not probe:
            return True
        timeout = float(probe.get("timeoutSeconds", 1))
        pod = self.store.find(self.pods, runtime.namespace, runtime.name)
        if pod is None:
            return False
        if "httpGet" in probe:
            port = named_port(pod, probe["httpGet"].get("port"), runtime.sandbox.port_map)
            path = probe["httpGet"].get("path", "/")
            if port is None or self._http is None:
                return False
            try:
                async with self._http.get(
                    f"http://{POD_IP}:{port}{path}", timeout=aiohttp.ClientTimeout(total=timeout)
                ) as response:
                    return 200 <= response.status < 400
            except (aiohttp.ClientError, TimeoutError):
                return False
        if "tcpSocket" in probe:
            port = named_port(pod, probe["tcpSocket"].get("port"), runtime.sandbox.port_map)
            if port is None:
                return False
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(POD_IP, port), timeout)
            except (OSError, TimeoutError):
                return False
            writer.close()
            return True
        return True  # exec and grpc probes are not emulated: they pass

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str | None:
        pod = self.store.find(self.pods, namespace, name)
        if pod is None:
            return None
        containers = [c["name"] for c in pod["spec"].get("containers") or []]
        chosen = container or (containers[0] if containers else None)
        if chosen is None:
            return None
        path = self.logs_dir / f"{namespace}_{name}_{chosen}.log"
        return path.read_text(errors="replace") if path.exists() else ""
