"""A kube-proxy on loopback: each ClusterIP Service's address answers.

The API server gives every Service a loopback address 127.0.x.y as its `spec.clusterIP`
(cluster_ips.py; headless Services keep None). `ServiceProxy` listens on that address
and each of the Service's ports while the Service has a ready endpoint, and forwards each
connection to one of them, round-robin: a pod the selector matches, Ready (readiness gates
included: the kubelet's Ready condition reflects them) and not being deleted, at the local port
behind `targetPort` (a number or a container port's name; `Kubelet.service_endpoints`).

Endpoints are read when a connection arrives, so new connections follow pods that come, go or
change readiness, and a selector change; open connections carry on. With no ready endpoint the
listener is closed, so a connection is refused, as kube-proxy's REJECT rule does.
"""

import asyncio
import contextlib
import errno
import ipaddress
import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .loop import woken
from .resources import ResourceType

if TYPE_CHECKING:
    from .store import Change, Store

logger = logging.getLogger(__name__)

# Ports of one Service port: the local ports of its ready endpoints.
Endpoints = Callable[[dict[str, Any], dict[str, Any]], list[int]]
ListenerKey = tuple[str, str, str, int]  # namespace, service, clusterIP, port
_BUFFER = 64 * 1024


def served_address(spec: dict[str, Any]) -> str | None:
    """The clusterIP the proxy serves, or None (headless, ExternalName, not loopback)."""
    address = spec.get("clusterIP")
    try:
        ip = ipaddress.ip_address(str(address))
    except ValueError:
        return None
    return str(ip) if ip.is_loopback and str(ip) != "127.0.0.1" else None


class ServiceProxy:
    """Runs on the API server's event loop, like the kubelet."""

    def __init__(self, store: "Store", services: ResourceType, endpoints: Endpoints) -> None:
        self.store, self.services, self.endpoints = store, services, endpoints
        self._listeners: dict[ListenerKey, asyncio.AbstractServer] = {}
        self._connections: set[asyncio.StreamWriter] = set()
        self._forwarding: set[asyncio.Task[Any]] = set()
        self._unservable: set[ListenerKey] = set()  # warned about once
        self.errors: list[str] = []  # its own failures (Cluster.problems() reports them)
        self._next: dict[ListenerKey, int] = {}  # round-robin position
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self.store.subscribe(self._changed)
        self._task = asyncio.create_task(self._loop(), name="test kube-proxy")

    def _changed(self, _change: "Change") -> None:
        if self._wake is not None:
            self._wake.set()

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                await self.sync()
            except Exception:
                self.errors.append(traceback.format_exc())
                logger.exception("test kube-proxy: sync failed")
            await woken(self._wake, 1.0)
            await asyncio.sleep(0.01)  # let a burst of writes settle into one pass

    def _wanted(self) -> dict[ListenerKey, tuple[dict[str, Any], dict[str, Any]]]:
        wanted = {}
        for svc in self.store.list_objects(self.services):
            address = served_address(svc.get("spec") or {})
            if address is None:
                continue
            meta = svc["metadata"]
            for port in svc["spec"].get("ports") or []:
                if port.get("protocol", "TCP") != "TCP":
                    continue
                key = (meta["namespace"], meta["name"], address, int(port["port"]))
                if self.endpoints(svc, port):
                    wanted[key] = (svc, port)
        return wanted

    async def sync(self) -> None:
        """Listen where a Service port has a ready endpoint, and nowhere else."""
        wanted = self._wanted()
        for key in [k for k in self._listeners if k not in wanted]:
            self._listeners.pop(key).close()  # open connections carry on
        for key in wanted:
            if key in self._listeners:
                continue
            namespace, name, address, port = key
            try:
                self._listeners[key] = await asyncio.start_server(
                    lambda r, w, key=key: self._forward(key, r, w),  # type: ignore[misc]
                    address,
                    port,
                    reuse_address=True,
                )
            except OSError as exc:
                # Another process holds it (e.g. a privileged port without the right):
                # connections to it are refused, as with no endpoint.
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                    raise
                if key in self._unservable:
                    continue
                self._unservable.add(key)
                logger.warning(
                    "test kube-proxy: cannot serve %s/%s at %s:%s: %s",
                    namespace,
                    name,
                    address,
                    port,
                    exc,
                )

    def _current(self, key: ListenerKey) -> list[int]:
        namespace, name, _, port = key
        svc = self.store.find(self.services, namespace, name)
        if svc is None or served_address(svc.get("spec") or {}) != key[2]:
            return []
        declared = next((p for p in svc["spec"].get("ports") or [] if int(p["port"]) == port), None)
        return [] if declared is None else self.endpoints(svc, declared)

    async def _forward(
        self, key: ListenerKey, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._forwarding.add(task)
            task.add_done_callback(self._forwarding.discard)
        self._connections.add(writer)
        try:
            endpoints = self._current(key)
            start = self._next.get(key, 0)
            self._next[key] = start + 1
            upstream = None
            for i in range(len(endpoints)):
                local = endpoints[(start + i) % len(endpoints)]
                with contextlib.suppress(OSError):
                    upstream = await asyncio.open_connection("127.0.0.1", local)
                    break
            if upstream is None:  # no endpoint answers: reset, as a REJECT would
                writer.transport.abort()
                return
            up_reader, up_writer = upstream
            self._connections.add(up_writer)
            try:
                await asyncio.gather(
                    self._pipe(reader, up_writer, writer), self._pipe(up_reader, writer, up_writer)
                )
            finally:
                self._connections.discard(up_writer)
                up_writer.close()
        finally:
            self._connections.discard(writer)
            writer.close()

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: asyncio.StreamWriter
    ) -> None:
        """Copy until EOF (passed on as a half-close); on an error, drop both sides."""
        try:
            while data := await reader.read(_BUFFER):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            writer.transport.abort()
            peer.transport.abort()

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for server in self._listeners.values():
            server.close()
        self._listeners.clear()
        for writer in list(self._connections):
            writer.transport.abort()
        if self._forwarding:  # each ends once its sockets are gone
            await asyncio.wait(self._forwarding, timeout=5.0)
