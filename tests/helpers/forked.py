"""`kvfence` processes (engines, routers, operators, the devcluster's pods) forked from a server
that imported them once.

A tiny engine spends about 2 s of CPU importing torch, FastAPI and the engine before it reads
its first flag, and the suite starts a few hundred engines and routers: on 2 cores that was a
fifth of `make test`. multiprocessing's fork server imports those modules once per test worker
and forks every child from there. Each child is still its own process running the real `kvfence`
command line, on its own socket (`--listen-fd`), with the environment the test gives it, its
own log, signals at their defaults and its exit code; only the interpreter's start is shared.

`LocalProcess.spawner` is set to one of these for the whole suite (tests/conftest.py), and so is
`ManagedProcess.spawner` (kvfence_devcluster: the kubelet's containers and the tests' operators)
for a `kvfence` command line or a hollow pod's; any other command line runs as a subprocess.
Tests whose subject is the start itself (`LocalProcess`, `kvfence serve`'s exit codes and
Ctrl-C) use `fresh_interpreters` and start real subprocesses; `kvfence up` and
`kvfence-devcluster` run as commands, and start theirs as subprocesses.
"""

import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path

from kvfence_engine.tools.localproc import Child, LocalProcess, Spawner, die_with_parent

# What a `kvfence serve`, `router` or `operator` imports before it does anything (an
# ImportError here would only cost the time again: the fork server skips a module it cannot
# import). Nothing that reads the environment when imported, which a child's own would not
# reach: not the operator's handlers (their reconcile interval), nor kopf, which imports the
# kubernetes client (KUBECONFIG).
PRELOAD = ("kvfence_cli.main", "kvfence_engine.serving.app", "kvfence_engine.router.app")
# The console script a pod's `kvfence` runs here (kvfence_devcluster.sandbox.COMMANDS). This
# module imports nothing of kvfence_devcluster: a forked child imports it before it takes its
# environment, and the devcluster package imports the kubernetes client (KUBECONFIG).
KVFENCE = str(Path(sys.executable).parent / "kvfence")


class ForkedChild:
    """subprocess.Popen's verbs over a multiprocessing child (its exit code, a signal's
    negated number, as Popen's)."""

    def __init__(self, process: BaseProcess, args: Sequence[str]) -> None:
        self.process = process
        self.args = list(args)
        assert process.pid is not None
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(["kvfence", *self.args], timeout or 0.0)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """A LocalProcess spawner: forks `kvfence ARGS` from multiprocessing's fork server."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(list(preload))

    def __call__(
        self, args: Sequence[str], env: Mapping[str, str], log: Path | None, listener: socket.socket
    ) -> Child:
        process = self.context.Process(
            target=run_kvfence,
            args=(list(args), dict(env), log, listener),
            name=f"kvfence {args[0] if args else ''}",
            daemon=True,  # a test worker that exits stops what it left running
        )
        process.start()
        return ForkedChild(process, args)

    def managed(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: Path | None, log: Path
    ) -> Child | None:
        """A ManagedProcess spawner: `kvfence ARGS` or a hollow pod, forked; None otherwise."""
        from kvfence_devcluster.hollow import HOLLOW_SCRIPT, hollow_argv

        if list(argv[:1]) == [KVFENCE]:
            script = None
        elif list(argv[:3]) == hollow_argv([KVFENCE]):
            script = HOLLOW_SCRIPT
        else:
            return None
        args = list(argv[1:] if script is None else argv[3:])
        process = self.context.Process(
            target=run_managed,
            args=(script, args, dict(env), cwd, log),
            name=f"{Path(script or KVFENCE).name} {args[0] if args else ''}",
            daemon=True,
        )
        process.start()
        return ForkedChild(process, args)


def run_kvfence(args: list[str], env: dict[str, str], log: Path | None, listener: socket.socket):
    """In the forked child: become `kvfence ARGS --listen-fd N` as a fresh interpreter would."""
    die_with_parent()  # the fork server's death ends it, as a test worker's ends a subprocess
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what Python's start installs
    fd = listener.detach()  # stays open: the child serves on it
    out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
    argv = [*args, "--listen-fd", str(fd)]
    sys.argv = ["kvfence", *argv]
    from kvfence_cli.main import main

    sys.exit(main(argv))


def run_managed(
    script: str | None, args: list[str], env: dict[str, str], cwd: Path | None, log: Path
) -> None:
    """In the forked child: become what ManagedProcess's subprocess would have run, in a
    session of its own (the kubelet stops a container's whole group)."""
    os.setsid()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
    if script is not None:  # a hollow pod: the file as `python -P FILE ARGS` runs it
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)
    sys.argv = [KVFENCE, *args]
    from kvfence_cli.main import main

    sys.exit(main(args))


@contextmanager
def fresh_interpreters() -> Iterator[None]:
    """LocalProcess starts real subprocesses meanwhile."""
    spawner: Spawner | None = LocalProcess.spawner
    LocalProcess.spawner = None
    try:
        yield
    finally:
        LocalProcess.spawner = spawner
