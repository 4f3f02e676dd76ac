"""Run kvfence components as local processes on loopback and wait until they are ready.

Used by `kvfence up`, the benchmarks and the tests: one way to start a server and know it
answers, instead of one per caller.
"""

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import ClassVar, Protocol

import httpx

from kvfence_engine.tools import http_clients

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: SIGTERM this child when the thread that started it dies, even by SIGKILL, so a
    killed `kvfence up` (or test run) never leaves engines running behind it. And Ctrl-C
    reaches it as it would from a shell: an ignored SIGINT is inherited across exec (`up`
    ignores further signals while it stops), and a server that starts with SIGINT ignored
    shuts down on it but exits 0, not 130."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# A port free_port handed out stays off-limits to the next free_port or loopback_socket, in
# any process on this machine, for this long: time for whatever it was for to bind it. The
# kernel's bind(0) knows nothing of a port that was just let go, and may give it to the next
# caller (a parallel test's engine) before its first owner has bound it.
HANDED_OUT_SECONDS = 120.0

# How long wait_ready (and `with LocalProcess(...)`) waits by default: a hang guard for the
# benchmarks and the tests, not a promise of how fast a start is. A tiny-random engine is
# ready in seconds on a quiet machine and took 155 s on a loaded 2-core one (issue 34).
# `kvfence up` passes its own limit.
READY_TIMEOUT_SECONDS = 600.0


@contextlib.contextmanager
def _handed_out() -> Iterator[dict[int, float]]:
    """The ports free_port handed out lately (port -> until when), under a lock on a file
    shared by every process of this user; what the caller adds is kept."""
    book = Path(tempfile.gettempdir()) / f"kvfence-free-ports-{os.getuid()}"
    with open(book, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
        f.seek(0)
        now, recent = time.time(), {}
        for entry in f.read().split():
            port, _, until = entry.partition("@")
            with contextlib.suppress(ValueError):
                if float(until) > now:
                    recent[int(port)] = float(until)
        yield recent
        f.seek(0)
        f.truncate()
        f.write("".join(f"{port}@{until:.1f}\n" for port, until in recent.items()))


def free_port() -> int:
    """A port free now, for something not started here (a URL nothing answers on, a pod's
    port in the devcluster). It is not bound: a child that must listen on a free port should
    get a bound socket instead (`LocalProcess`). Until then, no other free_port or
    loopback_socket hands it out (`HANDED_OUT_SECONDS`)."""
    with _handed_out() as recent:
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in recent:
                break
        recent[port] = time.time() + HANDED_OUT_SECONDS
        return port


def loopback_socket(port: int = 0) -> socket.socket:
    """A TCP socket bound to 127.0.0.1:port (0: any free port free_port did not just hand
    out), not listening: held, it keeps the port from anyone else; connections to it are
    refused until its server listens."""
    if port:
        return _bound(port)
    rejected: list[socket.socket] = []  # held until a good one is found: bind(0) moves on
    try:
        with _handed_out() as recent:
            while True:
                sock = _bound(0)
                if sock.getsockname()[1] not in recent or len(rejected) >= 100:
                    return sock
                rejected.append(sock)
    finally:
        for sock in rejected:
            sock.close()


def _bound(port: int) -> socket.socket:
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


class ProcessFailed(RuntimeError):
    pass


class Readiness(StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"  # exited, or its /readyz says it will never be ready


@dataclass(frozen=True, slots=True)
class Probe:
    readiness: Readiness
    reason: str = ""  # for FAILED: the process's own words


def last_line(path: Path | None) -> str:
    """The last non-empty line of a log: where `kvfence serve` and `kvfence router` put why
    they stopped (what a kubelet's FallbackToLogsOnError shows, in one line)."""
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
        lines = f.read().decode(errors="replace").splitlines()
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


class Child(Protocol):
    """A started child, as LocalProcess and its callers use it: subprocess.Popen's verbs."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Spawner(Protocol):
    """Starts `kvfence ARGS --listen-fd N` serving on the child's copy N of `listener`, with
    exactly `env` as its environment and its stdout and stderr in `log` (nothing if None)."""

    def __call__(
        self, args: Sequence[str], env: Mapping[str, str], log: Path | None, listener: socket.socket
    ) -> Child: ...


@dataclass
class LocalProcess:
    """A `kvfence <command>` child process serving HTTP on 127.0.0.1:port.

    Its socket is bound here, before the child starts, and handed to it (`--listen-fd`): the
    port is the child's from the moment it is chosen, with no window in which another
    process (a parallel test, another engine) could take it."""

    args: Sequence[str]
    listener: socket.socket = field(default_factory=loopback_socket)
    env: Mapping[str, str] | None = None
    log_path: Path | None = None
    proc: Child | None = None
    port: int = field(init=False)
    launcher: ClassVar[Sequence[str]] = (sys.executable, "-m", "kvfence_cli")
    # None: a fresh interpreter runs `launcher ARGS` (subprocess). The tests fork theirs from a
    # server that has imported the engine already (tests/helpers/forked.py).
    spawner: ClassVar[Spawner | None] = None

    def __post_init__(self) -> None:
        self.port = int(self.listener.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LocalProcess":
        env = {**os.environ, **(self.env or {})}
        try:
            spawn = self.spawner or self._subprocess
            self.proc = spawn(self.args, env, self.log_path, self.listener)
        finally:
            self.listener.close()  # the child has its own copy: the port is its now
        return self

    def _subprocess(
        self, args: Sequence[str], env: Mapping[str, str], log: Path | None, listener: socket.socket
    ) -> Child:
        fd = listener.fileno()
        out = open(log, "wb") if log else None  # noqa: SIM115
        try:
            return subprocess.Popen(
                [*self.launcher, *args, "--listen-fd", str(fd)],
                env=env,
                stdout=out or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                pass_fds=(fd,),
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        finally:
            if out is not None:
                out.close()  # the child has its own copy of this

    def probe(self, path: str = "/readyz") -> Probe:
        """One look at the process and its readiness endpoint."""
        assert self.proc is not None, "start() first"
        if self.proc.poll() is not None:
            said = last_line(self.log_path)
            return Probe(Readiness.FAILED, f"exited with {self.proc.returncode}: {said}".strip())
        try:
            response = http_clients.get(self.url + path, timeout=1.0)
        except httpx.HTTPError:
            return Probe(Readiness.STARTING)
        if response.status_code == 200:
            return Probe(Readiness.READY)
        try:
            body = response.json()
        except ValueError:
            return Probe(Readiness.STARTING)
        if isinstance(body, dict) and body.get("status") == "failed":
            return Probe(Readiness.FAILED, str(body.get("error") or "failed"))
        return Probe(Readiness.STARTING)

    def wait_ready(
        self, timeout: float = READY_TIMEOUT_SECONDS, path: str = "/readyz"
    ) -> "LocalProcess":
        """Until ready; ProcessFailed as soon as it exits or says it failed, quoting why."""
        wait_all_ready({f"kvfence {' '.join(self.args)} on port {self.port}": self}, timeout, path)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.listener.close()  # never started: free the port
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def describe(self) -> str:
        log = f" (log: {self.log_path})" if self.log_path else ""
        return f"kvfence {' '.join(self.args)} on port {self.port}{log}"

    def __enter__(self) -> "LocalProcess":
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_all_ready(
    procs: Mapping[str, LocalProcess],
    timeout: float,
    path: str = "/readyz",
    on_ready: Callable[[str, LocalProcess], None] = lambda name, proc: None,
) -> None:
    """Watch every process and its readiness endpoint at once: ProcessFailed as soon as one
    exits or says it failed, in its own words and naming its log, or when time runs out."""
    deadline = time.monotonic() + timeout
    pending = dict(procs)
    pause = 0.05
    while pending:
        for name, proc in list(pending.items()):
            probe = proc.probe(path)
            if probe.readiness is Readiness.READY:
                del pending[name]
                on_ready(name, proc)
            elif probe.readiness is Readiness.FAILED:
                raise ProcessFailed(
                    f"{name} failed to start: {probe.reason} (log: {proc.log_path})"
                )
        if pending and time.monotonic() > deadline:
            logs = ", ".join(str(proc.log_path) for proc in pending.values())
            raise ProcessFailed(
                f"{', '.join(pending)} not ready after {timeout:.0f}s (logs: {logs})"
            )
        if pending:
            time.sleep(pause)
            pause = min(pause * 2, 1.0)  # quick for a fast start, quiet for a slow one
