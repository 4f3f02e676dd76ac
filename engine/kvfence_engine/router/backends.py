"""The router's view of prefill and decode instances: least-outstanding choice (or prefix-aware,
see placement.py), dead instances out of rotation for a while, and the set the operator writes
(backends file) and pushes."""

import logging
import os
import socket
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from kvfence_engine.contracts import BackendsFile, BackendsInForce, BackendsSource, Role
from kvfence_engine.core import errors
from kvfence_engine.router.placement import Candidate, PrefixRouting

log = logging.getLogger(__name__)
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

    def pick_by_prefix(self, routing: PrefixRouting, tenant: str, prompt_ids: list[int]) -> Backend:
        """The instance whose prefix cache most likely holds this tenant's prompt (see
        placement.py), passing over down or overloaded ones."""
        now = time.monotonic()
        candidates = [Candidate(b.url, b.outstanding, b.down_until <= now) for b in self.backends]
        try:
            url = routing.choose(tenant, prompt_ids, candidates)
        except ValueError:
            raise errors.overloaded(
                f"no {self.role} instance is reachable", retry_after=2
            ) from None
        return next(b for b in self.backends if b.url == url)

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


class StalePush(ValueError):
    """A pushed set older than the one in force (a lagging writer): refused, nothing changes."""


def check_urls(written: BackendsFile) -> None:
    """Every URL an http(s) URL with a host, as `expand` needs (ValueError otherwise)."""
    for url in (*written.prefill, *written.decode):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend URL {url!r} is not http(s)://HOST[:PORT]")


@dataclass(slots=True)
class Backends:
    """The set in force: from --prefill/--decode, the backends file (re-read when it changes)
    or the operator's push, whichever is newest by BackendsFile.version. The file is the
    start-up source; once a push is in force, a file replaces it only with a higher version,
    so a ConfigMap volume refreshed late (by a minute, in Kubernetes) never rolls it back."""

    prefill: BackendPool
    decode: BackendPool
    prefill_urls: list[str]
    decode_urls: list[str]
    file: Path | None = None
    context_length: int | None = None  # what the operator last wrote, if anything
    model_name: str | None = None  # the id to advertise (spec.model.name), if the file says
    in_force: BackendsFile = field(default_factory=BackendsFile)
    source: BackendsSource = "flags"
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
            in_force=BackendsFile(prefill=prefill, decode=decode),
        )
        b.refresh(force=True)
        return b

    def report(self) -> BackendsInForce:
        return BackendsInForce(
            source=self.source, digest=self.in_force.digest(), backends=self.in_force
        )

    def push(self, written: BackendsFile) -> None:
        """Put a pushed set in force now (new requests go only to its backends; those in
        flight finish where they are). StalePush if a newer set is in force; ValueError for a
        URL that is not http(s)://HOST[:PORT] or a push without a version (0, the default:
        a hand-written file's, which a push could not order against another push)."""
        check_urls(written)
        if written.version == 0:
            raise ValueError("a push needs its version (>= 1); version 0 is a hand-written file's")
        if written.version < self.in_force.version:
            raise StalePush(
                f"version {written.version} is older than the set in force "
                f"(version {self.in_force.version}, from the {self.source})"
            )
        self._apply(written, "push")

    def _apply(self, written: BackendsFile, source: BackendsSource) -> None:
        self.in_force, self.source = written, source
        self.prefill_urls = list(written.prefill)
        self.decode_urls = list(written.decode)
        self.context_length = written.context_length
        self.model_name = written.model.name if written.model else None
        self._resolve()

    def _resolve(self) -> None:
        self._resolved_at = time.monotonic()
        self.prefill.set_urls([u for url in self.prefill_urls for u in expand(url)])
        self.decode.set_urls([u for url in self.decode_urls for u in expand(url)])

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
                    if self.source != "push" or written.version > self.in_force.version:
                        self._apply(written, "file")
                        return
                    log.info(
                        "backends file version %d ignored: not newer than the pushed %d",
                        written.version,
                        self.in_force.version,
                    )
                force = True
        if force or time.monotonic() - self._resolved_at > 5.0:
            self._resolve()
