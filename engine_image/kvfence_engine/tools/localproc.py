"""Run kvfence components as local processes on loopback and wait until they are ready.

Used by `kvfence up`, the benchmarks and the tests: one way to start a server and know it
answers, instead of one per caller.
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the thread that started it dies, even by SIGKILL, so a
    killed `kvfence up` (or test run) never leaves engines running behind it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProcessFailed(RuntimeError):
    pass


@dataclass
class LocalProcess:
    """A `kvfence <command>` child process serving HTTP on 127.0.0.1:port."""

    args: Sequence[str]
    port: int = field(default_factory=free_port)
    env: Mapping[str, str] | None = None
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LocalProcess":
        command = [sys.executable, "-m", "kvfence_cli", *self.args, "--port", str(self.port)]
        env = {**os.environ, **(self.env or {})}
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        return self

    def wait_ready(self, timeout: float = 120.0, path: str = "/readyz") -> "LocalProcess":
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessFailed(f"{self.describe()} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise ProcessFailed(f"{self.describe()} not ready after {timeout:.0f}s")

    def stop(self, timeout: float = 10.0) -> None:
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
