"""The test cluster as one object: `start_cluster()` (a context manager) and the `cluster`
pytest fixture (import `cluster_fixture` into a conftest.py or test module; pytest knows it
as `cluster`).

Everything runs in this process except the pods and the operator: the API server and the
kubelet share one event loop in a background thread; the test talks to them over HTTP.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

import httpx
import kmock
import pytest
from kubernetes import client, config

from .apiserver import INFERENCE_DEPLOYMENT_CRD, ApiServer, write_kubeconfig
from .controllers import condition
from .counting import RequestCounts
from .in_cluster import https_listener
from .kubelet import Kubelet
from .loop import BackgroundLoop
from .options import KubeletOptions
from .processes import ManagedProcess
from .proxy import ServiceProxy
from .resources import ResourceType
from .sandbox import VENV_BIN
from .store import MERGE_PATCH
from .waiting import FACT_S, eventually

T = TypeVar("T")
PATCH_TYPES = {
    "merge": MERGE_PATCH,
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
}


class ClusterApiError(RuntimeError):
    def __init__(self, response: httpx.Response) -> None:
        self.status = response.status_code
        try:
            self.body: Any = response.json()
        except ValueError:
            self.body = response.text
        message = self.body.get("message") if isinstance(self.body, dict) else self.body
        super().__init__(
            f"{response.request.method} {response.request.url.path} -> {self.status}: {message}"
        )


class Cluster:
    """A running test cluster. Kinds are named by kind or plural ("Deployment",
    "deployments"), with api_version only where a kind is ambiguous."""

    def __init__(
        self,
        workdir: Path,
        loop: BackgroundLoop,
        server: ApiServer,
        kubelet: Kubelet | None,
        url: str,
    ) -> None:
        self.workdir, self.loop, self.server, self.kubelet, self.url = (
            workdir,
            loop,
            server,
            kubelet,
            url,
        )
        self.kubeconfig = write_kubeconfig(workdir / "kubeconfig", url)
        self.logs_dir = workdir / "logs"
        self._http = httpx.Client(base_url=url, timeout=30.0)
        self._api_client: client.ApiClient | None = None
        self._processes: list[ManagedProcess] = []
        self._kinds: dict[tuple[str, str | None], ResourceType] = {}
        self.proxy: ServiceProxy | None = None

    @property
    def api_client(self) -> client.ApiClient:
        """The official client, configured from this cluster's kubeconfig only."""
        if self._api_client is None:
            self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    # ---- raw API ----------------------------------------------------------------------------

    def resource(self, kind: str, api_version: str | None = None) -> ResourceType:
        """A kind ("Deployment") or plural ("deployments"); the core group wins, then custom
        resources, where a name is ambiguous (give api_version to choose)."""
        if (kind, api_version) not in self._kinds:
            self._kinds[kind, api_version] = self.loop.run(self._resolve(kind, api_version))
        return self._kinds[kind, api_version]

    async def _resolve(self, kind: str, api_version: str | None) -> ResourceType:
        candidates = [
            rt
            for rt in self.server.resource_types()
            if kind in (rt.kind, rt.plural) and api_version in (None, rt.api_version)
        ]
        if not candidates:
            raise KeyError(f"the test API server does not serve {api_version or ''} {kind}")
        return sorted(candidates, key=lambda rt: (rt.group != "", not rt.custom, rt.group))[0]

    @staticmethod
    def path(
        rt: ResourceType,
        namespace: str | None = None,
        name: str | None = None,
        subresource: str | None = None,
    ) -> str:
        parts = ["/api" if not rt.group else f"/apis/{rt.group}", rt.version]
        if rt.namespaced and namespace:
            parts += ["namespaces", namespace]
        parts += [rt.plural, *(p for p in (name, subresource) if p)]
        return "/".join(parts)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._http.request(method, path, **kwargs)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ClusterApiError(response)
        return response.json()

    # ---- objects ----------------------------------------------------------------------------

    def create(self, manifest: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        rt = self.resource(manifest["kind"], manifest.get("apiVersion"))
        ns = namespace or (manifest.get("metadata") or {}).get("namespace") or "default"
        return dict(self._call("POST", self.path(rt, ns), json=manifest))

    def get(
        self, kind: str, name: str, namespace: str = "default", api_version: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        response = self.request("GET", self.path(self.resource(kind, api_version), namespace, name))
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise ClusterApiError(response)
        return dict(response.json())

    def require(
        self, kind: str, name: str, namespace: str = "default", api_version: str | None = None
    ) -> dict[str, Any]:
        """The object, which must exist: get() for a test that reads it; a missing one raises
        LookupError naming it (inside wait_for, an observation to retry)."""
        found = self.get(kind, name, namespace, api_version)
        if found is None:
            raise LookupError(f"{kind} {namespace}/{name} does not exist")
        return found

    def list(
        self,
        kind: str,
        namespace: str | None = None,
        labels: Mapping[str, str] | str | None = None,
        fields: str | None = None,
        api_version: str | None = None,
    ) -> list[dict[str, Any]]:
        """Objects in one namespace (all namespaces if None), by label selector (a dict of
        equalities or a selector string such as "tier in (a,b),!canary")."""
        if isinstance(labels, Mapping):
            labels = ",".join(f"{k}={v}" for k, v in labels.items())
        params = {k: v for k, v in (("labelSelector", labels), ("fieldSelector", fields)) if v}
        path = self.path(self.resource(kind, api_version), namespace)
        return list(self._call("GET", path, params=params)["items"])

    def patch(
        self,
        kind: str,
        name: str,
        patch: Any,
        namespace: str = "default",
        subresource: str | None = None,
        patch_type: str = "merge",
        api_version: str | None = None,
    ) -> dict[str, Any]:
        """patch_type: merge (RFC 7386), json (RFC 6902) or strategic."""
        path = self.path(self.resource(kind, api_version), namespace, name, subresource)
        headers = {"Content-Type": PATCH_TYPES[patch_type]}
        return dict(self._call("PATCH", path, content=json.dumps(patch), headers=headers))

    def replace(self, obj: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        rt = self.resource(obj["kind"], obj.get("apiVersion"))
        meta = obj["metadata"]
        path = self.path(rt, meta.get("namespace"), meta["name"], subresource)
        return dict(self._call("PUT", path, json=obj))

    def delete(
        self,
        kind: str,
        name: str,
        namespace: str = "default",
        propagation: str | None = "Background",
        api_version: str | None = None,
    ) -> bool:
        """False if it did not exist. propagation None: the kind's default (Jobs: Orphan)."""
        path = self.path(self.resource(kind, api_version), namespace, name)
        body = {"propagationPolicy": propagation} if propagation else None
        response = self.request("DELETE", path, json=body)
        if response.status_code == 404:
            return False
        if response.status_code >= 400:
            raise ClusterApiError(response)
        return True

    # ---- waiting ----------------------------------------------------------------------------

    @overload
    def wait_for(
        self,
        observe: Callable[[], T | None],
        what: str,
        timeout: float = FACT_S,
        *,
        interval: float = 0.1,
    ) -> T: ...

    @overload
    def wait_for(
        self,
        observe: Callable[[], T],
        what: str,
        timeout: float = FACT_S,
        until: Callable[[T], object] = bool,
        interval: float = 0.1,
    ) -> T: ...

    def wait_for(
        self,
        observe: Callable[[], T],
        what: str,
        timeout: float = FACT_S,
        until: Callable[[T], object] = bool,
        interval: float = 0.1,
    ) -> T:
        """eventually() (waiting.py) with the cluster's state (pods, logs) in its failure;
        without `until`, never None (its first overload)."""
        return eventually(observe, what, timeout, until, interval, describe=self.describe)

    def wait_gone(
        self, kind: str, name: str, namespace: str = "default", timeout: float = 30.0
    ) -> None:
        self.wait_for(
            lambda: self.get(kind, name, namespace),
            f"{kind} {namespace}/{name} to be gone",
            timeout,
            until=lambda o: o is None,
        )

    # ---- pods -------------------------------------------------------------------------------

    @staticmethod
    def pod_url(pod: Mapping[str, Any], port: str | int = "http") -> str:
        """http://<podIP>:<containerPort>, the port named (or numbered) `port`."""
        for container in pod["spec"]["containers"]:
            for declared in container.get("ports") or []:
                if port in (declared.get("name"), declared["containerPort"]):
                    return f"http://{pod['status']['podIP']}:{declared['containerPort']}"
        raise KeyError(f"pod {pod['metadata']['name']} declares no port {port!r}")

    @staticmethod
    def pod_condition(pod: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
        return condition(dict(pod), kind)

    @staticmethod
    def require_condition(obj: Mapping[str, Any], kind: str) -> dict[str, Any]:
        """The condition of that type, which must be there (pod_condition() for any object):
        LookupError naming the object otherwise (inside wait_for, an observation to retry)."""
        found = condition(dict(obj), kind)
        if found is None:
            meta = obj.get("metadata") or {}
            raise LookupError(
                f"{obj.get('kind', 'object')} {meta.get('namespace')}/{meta.get('name')} "
                f"has no {kind} condition"
            )
        return found

    def pod_log(self, name: str, namespace: str = "default", container: str | None = None) -> str:
        """A container's log (the first container's by default), through the API while the pod
        exists, from the logs directory after it was deleted."""
        params = {"container": container} if container else None
        response = self.request(
            "GET", f"/api/v1/namespaces/{namespace}/pods/{name}/log", params=params
        )
        if response.status_code == 404:
            files = sorted(self.logs_dir.glob(f"{namespace}_{name}_{container or '*'}.log"))
            if files:
                return files[0].read_text(errors="replace")
        if response.status_code >= 400:
            raise ClusterApiError(response)
        return response.text

    # ---- kubectl ----------------------------------------------------------------------------

    def kubectl_env(self) -> dict[str, str]:
        """The environment for the real `kubectl` on PATH against this cluster: its kubeconfig,
        and a discovery/OpenAPI cache of its own (ports are reused; the user's cache is not)."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBECACHEDIR": str(self.workdir / "kubectl-cache"),
        }

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run `kubectl ARGS`; with check, a non-zero exit fails naming the command and its
        output."""
        executable = shutil.which("kubectl")
        if executable is None:
            raise RuntimeError("kubectl is not on PATH (the machine image ships kubectl 1.32)")
        done = subprocess.run(
            [executable, *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.kubectl_env(),
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {done.returncode}\n"
                f"stdout: {done.stdout}\nstderr: {done.stderr}"
            )
        return done

    # ---- processes --------------------------------------------------------------------------

    def start_process(
        self, argv: Sequence[str], name: str, env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        """A process that talks to this cluster (KUBECONFIG set), stopped at teardown."""
        environment = {**os.environ, "KUBECONFIG": str(self.kubeconfig), **(env or {})}
        log_path = self.logs_dir / f"{name}-{len(self._processes)}.log"
        process = ManagedProcess(list(argv), log_path, environment, self.workdir).start()
        self._processes.append(process)
        return process

    def start_operator(
        self, args: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        """`kvfence operator ARGS` against this cluster. `.kill()` simulates a crash, `.stop()`
        a graceful shutdown; call again to start a fresh one."""
        return self.start_process([str(VENV_BIN / "kvfence"), "operator", *args], "operator", env)

    # ---- API load ---------------------------------------------------------------------------

    def requests(self, reset: bool = False) -> RequestCounts:
        """The requests the API server has answered so far, by verb, resource and user agent
        (counting.py); `reset` starts the count again from zero."""
        return self.server.counter.snapshot(reset)

    # ---- diagnostics ------------------------------------------------------------------------

    def problems(self) -> builtins.list[str]:
        """Failures of the test cluster itself (not API errors such as 404)."""
        server = [f"API server: {e!r}" for e in self.loop.run(self._server_errors())]
        kubelet = self.kubelet.errors if self.kubelet else []
        proxy = self.proxy.errors if self.proxy else []
        return server + [f"kubelet: {e}" for e in kubelet] + [f"kube-proxy: {e}" for e in proxy]

    async def _server_errors(self) -> builtins.list[Exception]:
        return self.server.internal_errors()

    def describe(self, log_lines: int = 15) -> str:
        """Pods, Deployments and Jobs with their state, and the tail of every log."""
        lines = [f"test cluster {self.url} (workdir {self.workdir})"]
        try:
            for kind in ("Deployment", "Job", "Pod"):
                for obj in self.list(kind):
                    meta, status = obj["metadata"], obj.get("status") or {}
                    conditions = ", ".join(
                        f"{c['type']}={c['status']}"
                        + (f" ({c['reason']})" if c.get("reason") else "")
                        for c in status.get("conditions") or []
                    )
                    extra = ""
                    if kind == "Pod":
                        states = [
                            next(iter(c.get("state") or {"?": 0}))
                            for c in status.get("containerStatuses") or []
                        ]
                        extra = f" phase={status.get('phase')} containers={states}"
                    lines.append(
                        f"  {kind} {meta['namespace']}/{meta['name']}{extra} [{conditions}]"
                    )
        except Exception as exc:  # describing must never hide the original failure
            lines.append(f"  (could not list objects: {exc!r})")
        for log in sorted(self.logs_dir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-log_lines:]
            lines.append(f"--- {log.name} (last {len(tail)} lines)")
            lines.extend(f"    {line}" for line in tail)
        return "\n".join(lines)

    def close(self) -> None:
        for process in reversed(self._processes):
            process.stop(grace=5.0)
        self._http.close()
        if self._api_client is not None:
            self._api_client.close()


TEARDOWN_S = 60.0


@contextlib.contextmanager
def start_cluster(
    workdir: Path,
    *,
    kubelet: KubeletOptions | bool = True,
    crds: Sequence[Path] = (INFERENCE_DEPLOYMENT_CRD,),
) -> Iterator[Cluster]:
    """API server (with the CRDs installed) and, unless kubelet=False, the test kubelet.
    Everything is torn down on exit, every pod and started process killed, even on failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    loop = BackgroundLoop().start()
    stack = contextlib.AsyncExitStack()
    running: Cluster | None = None

    async def start() -> tuple[ApiServer, Kubelet | None, ServiceProxy | None, str]:
        server = ApiServer()
        await stack.enter_async_context(server)
        http = await stack.enter_async_context(kmock.Server(server))
        for crd in crds:
            server.install_crd_file(crd)
        node, proxy = None, None
        if kubelet is not False:
            options = kubelet if isinstance(kubelet, KubeletOptions) else KubeletOptions()
            access = None
            if options.runtime == "podman":  # pods in containers reach the API as real ones
                access = await stack.enter_async_context(https_listener(server))
            node = Kubelet(server.store, server.resource_type, workdir, options, access)
            server.pod_logs = node.pod_log
            await node.start()
            stack.push_async_callback(node.shutdown)
            proxy = ServiceProxy(
                server.store, server.resource_type("", "v1", "services"), node.service_endpoints
            )
            await proxy.start()
            stack.push_async_callback(proxy.shutdown)
        return server, node, proxy, str(http.url).rstrip("/")

    try:
        server, node, proxy, url = loop.run(start())
        running = Cluster(workdir, loop, server, node, url)
        running.proxy = proxy
        yield running
    finally:
        try:
            if running is not None:
                running.close()
            try:
                loop.run(stack.aclose(), timeout=TEARDOWN_S)
            except TimeoutError:
                raise TimeoutError(
                    f"the test cluster did not stop in {TEARDOWN_S} s:\n{loop.stacks()}"
                ) from None
        finally:
            loop.stop()
            if running is not None and running.kubelet is not None:
                running.kubelet.kill_all()  # whatever a failed shutdown left running


@pytest.fixture(name="cluster")
def cluster_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """A fresh test cluster per test, its pods hollow (hollow.py) for a test marked
    `@pytest.mark.hollow`; fails the test if the cluster itself misbehaved."""
    hollow = request.node.get_closest_marker("hollow") is not None
    with start_cluster(tmp_path / "cluster", kubelet=KubeletOptions(hollow=hollow)) as running:
        yield running
        problems = running.problems()
    assert not problems, (
        "the test cluster failed (a bug or gap in kvfence_devcluster):\n" + "\n".join(problems)
    )
