"""How `kvfence serve` starts, and how it refuses to: one line saying why, and an exit code a
kubelet (or `kvfence up`) acts on, instead of a process that stays up and is never ready."""

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from helpers.forked import fresh_interpreters
from helpers.processes import serve
from helpers.waits import READY_S
from kvfence_engine.tools.localproc import LocalProcess


@pytest.fixture(autouse=True)
def real_subprocesses() -> Iterator[None]:
    """This module's subject is how a process starts: a fresh interpreter, not a fork."""
    with fresh_interpreters():
        yield


def kvfence(*args: str, timeout: float = READY_S) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvfence_cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_an_unloadable_model_exits_1_with_the_reason_on_stderr_and_in_the_termination_log(
    tmp_path: Path,
) -> None:
    reason_file = tmp_path / "termination-log"
    done = kvfence(
        "serve", "--model", "builtin:tiny-randm", "--port", "0", "--threads", "1",
        "--termination-log", str(reason_file),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # it exits (kvfence's timeout: a hang guard)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvfence serve: engine failed to start: ValueError: cannot load model")
    assert "builtin:tiny-random" in last, "the valid builtins are named"
    assert "Traceback" not in done.stderr
    assert reason_file.read_text().strip() == last.removeprefix("kvfence serve: ")


def test_while_loading_health_answers_and_readyz_says_loading_or_why_it_failed(
    tmp_path: Path,
) -> None:
    """/healthz keeps a slow load alive under a liveness probe; the failure is on /readyz for
    as long as the process takes to exit."""
    proc = LocalProcess(
        ["serve", "--model", str(tmp_path / "missing.gguf"), "--threads", "1"],
        log_path=tmp_path / "bad.log",
    ).start()
    seen: set[str] = set()
    deadline = time.monotonic() + READY_S  # a hang guard
    try:
        assert proc.proc is not None
        while proc.proc.poll() is None:
            assert time.monotonic() < deadline, f"still running; readyz said {seen}"
            try:
                ready = httpx.get(proc.url + "/readyz", timeout=1.0)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            assert ready.status_code == 503
            seen.add(ready.json()["status"])
        assert proc.proc.returncode == 1
    finally:
        proc.stop()
    assert seen <= {"loading", "failed"}


def test_a_port_in_use_is_one_line_and_exit_2_before_anything_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = kvfence(
            "serve", "--model", "builtin:tiny-random", "--port", str(port), "--threads", "1"
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"kvfence serve: cannot listen on 127.0.0.1:{port}: address already in use "
        "(choose another --port)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_torch_without_it_is_refused_at_start_in_one_line() -> None:
    done = kvfence("serve", "--model", "builtin:tiny-random", "--port", "0", "--device", "cuda")
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("kvfence serve: --device cuda: ") and "--device cpu" in line


def test_health_probes_stay_out_of_the_access_log(tmp_path: Path) -> None:
    args = ("--model", "builtin:tiny-random", "--kv-cache-memory", "1Mi")
    with serve(tmp_path, "quiet", *args) as p:
        for _ in range(5):
            httpx.get(p.url + "/readyz").raise_for_status()
            httpx.get(p.url + "/healthz").raise_for_status()
        httpx.get(p.url + "/v1/kvpool").raise_for_status()
    log = (tmp_path / "quiet.log").read_text()
    assert "GET /v1/kvpool" in log, "other requests are still logged"
    assert "GET /readyz" not in log and "GET /healthz" not in log


@pytest.mark.parametrize("when", ["loading", "ready"])
def test_ctrl_c_stops_the_engine_with_130_and_no_traceback(tmp_path: Path, when: str) -> None:
    """While the weights load too: the loader's torch threads must not abort the exit."""
    model = "builtin:smollm2-135m-instruct" if when == "loading" else "builtin:tiny-random"
    log = tmp_path / "engine.log"
    proc = LocalProcess(["serve", "--model", model, "--threads", "1"], log_path=log).start()
    try:
        proc.wait_ready(path="/healthz" if when == "loading" else "/readyz")
        if when == "loading":
            assert httpx.get(proc.url + "/readyz").json()["status"] == "loading"
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGINT)
        assert proc.proc.wait(60) == 130
    finally:
        proc.stop()
    text = log.read_text()
    assert "Traceback" not in text and "terminate called" not in text, text[-2000:]


def test_int4_weights_for_a_model_without_4bit_blocks_exit_1_saying_what_to_use() -> None:
    done = kvfence(
        "serve", "--model", "builtin:tiny-random", "--weight-dtype", "int4", "--port", "0",
        "--threads", "1",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvfence serve: engine failed to start: ValueError: --weight-dtype int4")
    assert "use float16 or int8 for this model" in last and "Traceback" not in done.stderr


@pytest.mark.slow  # builds a checkpoint with transformers, then starts a process
def test_a_config_field_the_engine_does_not_implement_exits_1_naming_it(tmp_path: Path) -> None:
    """Issue #25: a checkpoint whose config.json asks for what kvfence does not compute is not
    served as something else (test_model_refusals.py: every refusal)."""
    from helpers.transformers_reference import hf_model

    hf_model(tmp_path, "LlamaConfig", hidden_act="gelu")
    done = kvfence("serve", "--model", str(tmp_path), "--port", "0", "--threads", "1")
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "kvfence serve: engine failed to start: ValueError: "
        f"{tmp_path / 'config.json'}: field 'hidden_act'='gelu' changes the computation and "
        "is not implemented (kvfence computes silu and gelu_pytorch_tanh)"
    )
    assert "Traceback" not in done.stderr
