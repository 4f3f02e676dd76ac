"""A child process in its own process group, logging to a file: what a container is to the test
kubelet, and what the operator is to a test (stop it, or kill it to simulate a crash)."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

from kvfence_engine.tools.localproc import Child, die_with_parent


class ProcessSpawner(Protocol):
    """Starts ARGV in a session of its own, in `cwd` with exactly `env`, stdin empty, stdout
    and stderr appended to `log`, as ManagedProcess's subprocess would; or None for an ARGV it
    does not start (ManagedProcess then runs a subprocess)."""

    def __call__(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: Path | None, log: Path
    ) -> Child | None: ...


@dataclass
class ManagedProcess:
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    popen: Child | None = field(default=None, init=False)
    # None: every ARGV runs as a subprocess. The tests fork `kvfence` and hollow pods from a
    # server that imported them once (tests/helpers/forked.py).
    spawner: ClassVar[ProcessSpawner | None] = None

    def start(self) -> "ManagedProcess":
        assert self.popen is None, "a ManagedProcess starts once; make a new one to restart"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"[cluster] starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            env = dict(self.env) if self.env is not None else dict(os.environ)
            if self.spawner is not None:
                self.popen = self.spawner(self.argv, env, self.cwd, self.log_path)
                if self.popen is not None:
                    return self
            # Its own session: stopping it also stops whatever it started (sh -c ...). And it
            # dies with the thread that started it, so a killed test run or `kvfence-devcluster`
            # leaves no pod or operator running behind it.
            self.popen = subprocess.Popen(
                list(self.argv),
                env=env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, "not started"
        return self.popen.pid

    @property
    def container_id(self) -> str:
        """What a pod's containerStatuses show as its containerID."""
        return f"kvfence-test://{self.pid}"

    def poll(self) -> int | None:
        """The exit code once it has exited, else None. As when a container's main process
        exits, whatever it left behind in its group is killed before the exit is collected."""
        if self.popen is None:
            return None
        if self.popen.returncode is None:
            try:  # exited? look without reaping: until reaped, the group id is still ours
                exited = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # a spawner's child: its fork server reaps it
                exited = None
                if self.popen.poll() is not None:
                    # the leader is gone; its group id is not reused while a member lives
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.popen.pid, signal.SIGKILL)
            if exited is not None:
                self._signal_group(signal.SIGKILL)
        return self.popen.poll()

    @property
    def running(self) -> bool:
        return self.popen is not None and self.poll() is None

    def _signal_group(self, sig: signal.Signals) -> None:
        # Only while the leader is unreaped: afterwards its number may be someone else's group.
        if self.popen is None or self.popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace` seconds. Returns the exit code."""
        if self.popen is None:
            return None
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.kill()

    async def astop(
        self, grace: float = 5.0, until: Callable[[], float] | None = None
    ) -> int | None:
        """stop() without blocking the event loop. `until`: the SIGKILL deadline
        (time.monotonic()), asked again while waiting (it may come closer), instead of
        `grace`."""
        if self.popen is None:
            return None
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.poll() is None and time.monotonic() < (until() if until else deadline):
            await asyncio.sleep(0.05)
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL the whole group at once (a crash, as far as the process can tell)."""
        if self.popen is None:
            return None
        self._signal_group(signal.SIGKILL)
        return self.popen.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def describe(self) -> str:
        state = "not started" if self.popen is None else f"pid {self.popen.pid}"
        if (code := self.poll()) is not None:
            state += f", exited {code}"
        return f"{' '.join(self.argv)} ({state}; log: {self.log_path})"

    def __enter__(self) -> "ManagedProcess":
        return self if self.popen is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
