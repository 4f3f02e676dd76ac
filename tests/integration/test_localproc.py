"""Local processes (`kvfence up`, tests, benches) never outlive what started them."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvfence_engine.tools.localproc import LocalProcess, ProcessFailed


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
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
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
    started = time.monotonic()
    try:
        with pytest.raises(ProcessFailed) as failed:
            proc.wait_ready(timeout=120)
    finally:
        proc.stop()
    assert time.monotonic() - started < 30
    assert "cannot load model" in str(failed.value) and "engine.log" in str(failed.value)
