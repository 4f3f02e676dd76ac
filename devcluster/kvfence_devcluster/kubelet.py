"""A kubelet for tests: every Pod in the store becomes local processes.

It runs on the API server's event loop, so its writes never race with a request. Each pass
runs the garbage collector's sweep for dependents of gone owners, the Deployment and Job
controllers, then starts a PodRuntime (pods.py) for every new pod and terminates the runtimes
of deleted ones. It also serves what pods need from the cluster:
ConfigMap and Secret data, Service resolution, readiness probes and logs.
"""

import asyncio
import base64
import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from .controllers import Controllers, pod_ready
from .in_cluster import InClusterAccess
from .loop import woken
from .options import KubeletOptions, host_cache_env
from .podman import PodmanRuntime
from .pods import Container, PodRuntime
from .processes import ManagedProcess
from .proxy import served_address
from .resources import ResourceType
from .runtime import ContainerRuntime, ProcessRuntime
from .sandbox import POD_IP, NotReadyToStart, named_port
from .selectors import selector_from_label_selector
from .store import Store
from .volumes import FILE_VOLUMES, sync_volume, volume_files

logger = logging.getLogger(__name__)


class Kubelet:
    def __init__(
        self,
        store: Store,
        resource_type: Callable[[str, str, str], ResourceType],
        workdir: Path,
        options: KubeletOptions | None = None,
        in_cluster: InClusterAccess | None = None,
    ) -> None:
        self.store = store
        self.options = options or KubeletOptions()
        self.runtime: ContainerRuntime = ProcessRuntime(self)
        if self.options.runtime == "podman":
            if in_cluster is None:
                raise ValueError("the podman runtime needs the API server's HTTPS access")
            self.runtime = PodmanRuntime(self, in_cluster)
        self.pods_dir, self.logs_dir = workdir / "pods", workdir / "logs"
        self.pods = resource_type("", "v1", "pods")
        self.services = resource_type("", "v1", "services")
        self.configmaps = resource_type("", "v1", "configmaps")
        self.secrets = resource_type("", "v1", "secrets")
        self.controllers = Controllers(store, resource_type)
        self.runtimes: dict[str, PodRuntime] = {}
        self.processes: list[ManagedProcess] = []  # every container ever started
        self.ports_given: set[int] = set()
        self.errors: list[str] = []
        self._terminating: dict[asyncio.Task[None], PodRuntime] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        # (pod uid, volume name) -> when a change to its ConfigMap was first seen
        self._configmap_changed_at: dict[tuple[str, str], float] = {}

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
            await woken(self._wake, self.options.tick)
            await asyncio.sleep(0.01)  # let a burst of writes settle into one pass

    def reconcile(self) -> None:
        self.store.collect_dangling()
        self.controllers.reconcile()
        pods = {p["metadata"]["uid"]: p for p in self.store.list_objects(self.pods)}
        for uid, runtime in list(self.runtimes.items()):
            pod = pods.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp") or evicted(pod):
                del self.runtimes[uid]
                task = asyncio.create_task(runtime.terminate())
                self._terminating[task] = runtime
                task.add_done_callback(self._terminating.pop)
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
        for runtime in [*runtimes, *self._terminating.values()]:
            runtime.hurry(2.0)  # teardown stays quick, whatever the pods' preStop and drains
        await asyncio.gather(
            *(r.terminate() for r in runtimes), *self._terminating, return_exceptions=True
        )
        self.runtime.sweep()
        if self._http is not None:
            await self._http.close()

    def kill_all(self) -> None:
        """The last resort at teardown, from any thread: SIGKILL every container ever started."""
        for process in self.processes:
            process.kill()
        self.runtime.sweep()

    # ---- what pods need -----------------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        """The machine's environment minus anything that points at the test cluster."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("KUBECONFIG", "HOME") and not k.startswith("KUBERNETES_")
        }
        return {**env, **host_cache_env(), **self.pod_env()}

    def pod_env(self) -> dict[str, str]:
        """What the test kubelet adds to every container's environment, whatever runs it."""
        env = {"KVFENCE_ALLOW_UNSAFE": "1"} if self.options.allow_unsafe else {}
        return {**env, **self.options.extra_env}

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
                if self._configmap_lagging(runtime, volume):
                    continue
                # A source that disappeared leaves the last files, as in Kubernetes.
                with contextlib.suppress(NotReadyToStart):
                    changed |= sync_volume(runtime.sandbox, volume, runtime.namespace, self)
        return changed

    def _configmap_lagging(self, runtime: PodRuntime, volume: dict[str, Any]) -> bool:
        """Whether a configMap volume's change is still inside options.configmap_volume_lag."""
        lag = self.options.configmap_volume_lag
        if lag <= 0 or "configMap" not in volume:
            return False
        key = (runtime.uid, volume["name"])
        try:
            _, sources = volume_files(volume, runtime.namespace, self)
        except NotReadyToStart:
            return False
        if sources == runtime.sandbox.volume_sources.get(volume["name"]):
            self._configmap_changed_at.pop(key, None)
            return False
        seen = self._configmap_changed_at.setdefault(key, time.monotonic())
        if time.monotonic() - seen < lag:
            return True
        self._configmap_changed_at.pop(key, None)
        return False

    def resolve_service(self, namespace: str, service: str, port: int | None) -> str | None:
        """Where `<service>.<namespace>.svc[:port]` leads, as host:port: the Service's
        clusterIP (the kube-proxy, proxy.py, forwards to its ready pods), or for a headless
        Service a Ready pod behind it, as its DNS name would resolve. None if neither."""
        svc = self.store.find(self.services, namespace, service)
        if svc is None:
            return None
        ports = svc["spec"].get("ports") or []
        chosen = next((p for p in ports if port is None or int(p["port"]) == port), None)
        if chosen is None:
            return None
        address = served_address(svc["spec"])
        if address is not None:
            return f"{address}:{chosen['port']}"
        local = next(iter(self.service_endpoints(svc, chosen)), None)
        return None if local is None else f"{POD_IP}:{local}"

    def service_endpoints(self, svc: dict[str, Any], port: dict[str, Any]) -> list[int]:
        """The local ports behind one of a Service's ports: its pods (the selector's) that are
        Ready and not being deleted (any, with publishNotReadyAddresses), at `targetPort`."""
        spec = svc.get("spec") or {}
        if not spec.get("selector"):
            return []
        target = port.get("targetPort", port["port"])
        selector = selector_from_label_selector({"matchLabels": spec["selector"]})
        namespace = svc["metadata"]["namespace"]
        found = []
        for pod in self.store.list_objects(self.pods, namespace, selector):
            if not spec.get("publishNotReadyAddresses") and (
                not pod_ready(pod) or pod["metadata"].get("deletionTimestamp")
            ):
                continue
            runtime = self.runtimes.get(pod["metadata"]["uid"])
            local = named_port(pod, target, runtime.sandbox.port_map if runtime else None)
            if local is not None:
                found.append(local)
        return found

    async def probe(
        self, runtime: PodRuntime, container: Container, kind: str = "readinessProbe"
    ) -> bool:
        """One try of a container's readinessProbe (run as often as probe_period) or
        livenessProbe (pods.py runs it on its own schedule). No probe: it passes."""
        probe = container.spec.get(kind)
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
                async with asyncio.timeout(timeout):  # not wait_for: loop.woken says why
                    _, writer = await asyncio.open_connection(POD_IP, port)
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


def evicted(pod: dict[str, Any]) -> bool:
    """Evicted (status phase Failed, reason Evicted, written through pods/status): its
    containers are stopped and the pod stays, finished, until someone deletes it."""
    status = pod.get("status") or {}
    return status.get("phase") == "Failed" and status.get("reason") == "Evicted"
