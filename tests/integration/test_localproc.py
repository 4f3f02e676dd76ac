"""Local processes (`kvfence up`, tests, benches) never outlive what started them."""

import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import httpx
import pytest

from helpers.forked import fresh_interpreters
from helpers.waits import FACT_S, READY_S
from kvfence_engine.tools.localproc import LocalProcess, ProcessFailed


@pytest.fixture(autouse=True)
def real_subprocesses() -> Iterator[None]:
    """This module's subject is how a process starts: a fresh interpreter, not a fork."""
    with fresh_interpreters():
        yield


NOBODY = "http://127.0.0.1:9"  # the discard port: nothing answers there


def test_an_engine_started_by_a_process_killed_with_sigkill_stops_too():
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import time
            from kvfence_engine.tools.localproc import LocalProcess
            args = ["serve", "--model", "builtin:tiny-random", "--kv-cache-memory", "1Mi"]
            p = LocalProcess(args)
            print(p.start().proc.pid, flush=True)
            time.sleep(120)
        """)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + FACT_S  # a hang guard
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        # A zombie until init reaps it counts as gone.
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":
                return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the engine outlived the process that started it")


def test_waiting_for_an_engine_that_cannot_load_fails_at_once_quoting_its_reason(tmp_path):
    proc = LocalProcess(
        ["serve", "--model", str(tmp_path / "missing.gguf"), "--threads", "1"],
        log_path=tmp_path / "engine.log",
    ).start()
    try:
        with pytest.raises(ProcessFailed) as failed:
            proc.wait_ready(timeout=READY_S)
    finally:
        proc.stop()
    # at once: on the engine's own failure, not at the deadline ("not ready after ...")
    assert "failed to start" in str(failed.value) and "not ready after" not in str(failed.value)
    assert "cannot load model" in str(failed.value) and "engine.log" in str(failed.value)


def test_a_local_process_holds_its_port_from_the_moment_it_is_made_and_hands_it_over(tmp_path):
    """No free-port race: the port is bound here before the child starts, and the child
    serves on that very socket (--listen-fd) instead of binding the port again."""
    proc = LocalProcess(
        ["serve", "--model", "builtin:tiny-random", "--kv-cache-memory", "1Mi", "--threads", "1"],
        log_path=tmp_path / "engine.log",
    )
    try:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", proc.port))
        assert taken.value.errno == errno.EADDRINUSE, "nobody else can have the port meanwhile"
        with pytest.raises(httpx.ConnectError):
            httpx.get(proc.url + "/healthz", timeout=2)  # held, not listening: refused
        proc.start().wait_ready(timeout=READY_S)
        assert httpx.get(proc.url + "/healthz", timeout=5).status_code == 200
    finally:
        proc.stop()
    assert f"listening on http://127.0.0.1:{proc.port}" in (tmp_path / "engine.log").read_text()


@pytest.mark.parametrize(
    ("command", "args"),
    [
        ("serve", ["--model", "builtin:tiny-random"]),
        ("router", ["--model", "builtin:tiny-random", "--prefill", NOBODY, "--decode", NOBODY]),
    ],
)
def test_a_listen_fd_that_is_not_a_bound_tcp_socket_is_one_line_and_exit_2(command, args):
    unbound = socket.socket()
    try:
        for fd, said in [
            (unbound.fileno(), f"--listen-fd {unbound.fileno()}: not a bound TCP socket"),
            (999, "--listen-fd 999: not an open socket (bad file descriptor)"),
        ]:
            result = subprocess.run(
                [sys.executable, "-m", "kvfence_cli", command, *args, "--listen-fd", str(fd)],
                pass_fds=(unbound.fileno(),),
                capture_output=True,
                text=True,
                timeout=120,
            )  # fmt: skip
            assert result.returncode == 2, result.stderr
            assert result.stderr.strip().splitlines()[-1] == f"kvfence {command}: {said}"
    finally:
        unbound.close()
