"""The router's view of prefill and decode instances: least-outstanding choice, dead instances
out of rotation for a while, and a backends file the operator rewrites."""

import os
import socket
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from kvfence_engine.contracts import BackendsFile, Role
from kvfence_engine.core import errors

DOWN_SECONDS = 5.0


@dataclass(slots=True)
class Backend:
    url: str
    outstanding: int = 0
    down_until: float = 0.0

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"


@dataclass(slots=True)
class BackendPool:
    role: Role
    backends: list[Backend] = field(default_factory=list)

    def set_urls(self, urls: list[str]) -> None:
        known = {b.url: b for b in self.backends}
        self.backends = [known.get(u) or Backend(u) for u in urls]

    def pick(self, exclude: AbstractSet[str] = frozenset()) -> Backend:
        now = time.monotonic()
        alive = [b for b in self.backends if b.down_until <= now and b.url not in exclude]
        if not alive:
            raise errors.overloaded(f"no {self.role} instance is reachable", retry_after=2)
        return min(alive, key=lambda b: b.outstanding)

    def mark_down(self, backend: Backend) -> None:
        backend.down_until = time.monotonic() + DOWN_SECONDS


def expand(url: str) -> list[str]:
    """A headless Service name stands for all its Ready pods: one backend per address."""
    parts = urlsplit(url)
    host = parts.hostname
    if host is None:
        raise ValueError(f"backend URL without a host: {url!r}")
    try:
        infos = socket.getaddrinfo(host, parts.port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []  # not resolvable (yet): no Ready pods behind it
    addresses = sorted({str(info[4][0]) for info in infos})
    if host in addresses or len(addresses) <= 1:
        return [url]
    port = f":{parts.port}" if parts.port else ""
    return [urlunsplit(parts._replace(netloc=f"{addr}{port}")) for addr in addresses]


@dataclass(slots=True)
class Backends:
    prefill: BackendPool
    decode: BackendPool
    prefill_urls: list[str]
    decode_urls: list[str]
    file: Path | None = None
    context_length: int | None = None  # what the operator last wrote, if anything
    model_name: str | None = None  # the id to advertise (spec.model.name), if the file says
    _mtime: float = -1.0
    _resolved_at: float = 0.0

    @classmethod
    def create(cls, prefill: list[str], decode: list[str], file: str | None) -> "Backends":
        b = cls(
            BackendPool(Role.PREFILL),
            BackendPool(Role.DECODE),
            prefill,
            decode,
            Path(file) if file else None,
        )
        b.refresh(force=True)
        return b

    def refresh(self, force: bool = False) -> None:
        """Re-read the backends file when it changed; re-resolve names every few seconds."""
        if self.file is not None:
            try:
                mtime = os.stat(self.file).st_mtime
            except FileNotFoundError:
                mtime = -1.0
            if mtime != self._mtime:
                self._mtime = mtime
                if mtime >= 0:
                    written = BackendsFile.model_validate_json(self.file.read_text())
                    self.prefill_urls = list(written.prefill)
                    self.decode_urls = list(written.decode)
                    self.context_length = written.context_length
                    self.model_name = written.model.name if written.model else None
                force = True
        if force or time.monotonic() - self._resolved_at > 5.0:
            self._resolved_at = time.monotonic()
            self.prefill.set_urls([u for url in self.prefill_urls for u in expand(url)])
            self.decode.set_urls([u for url in self.decode_urls for u in expand(url)])
