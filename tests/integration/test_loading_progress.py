"""A first start converts a GGUF model's weights (the slow part): a person can watch it, in
the engine's log and on its /readyz, which `kvfence up` reads for engines logging to files."""

import re
import time
from pathlib import Path

import httpx
import pytest

from kvfence_engine.contracts import EngineReadiness
from kvfence_engine.tools.localproc import LocalProcess

CONVERTING = r"converting SmolLM2-135M-Instruct\.Q4_1\.gguf: (\d+)/(\d+) tensors"
LOADING = r"loading builtin:smollm2-135m-instruct \[(\d)/5\] (.+)"
STEPS = [
    "reading SmolLM2-135M-Instruct.Q4_1.gguf (header and vocabulary)",
    "dequantizing the weights",
    "building the tokenizer",
    "saving the converted weights to the cache",
    "building the model on cpu and allocating its KV pool",
]


@pytest.mark.slow
def test_weight_conversion_shows_on_readyz_and_as_plain_lines_in_the_log(tmp_path: Path) -> None:
    """And every step of the load around it, each a line in the log as it starts: nothing of
    a start after the HTTP server answers goes unsaid (what follows the conversion, the save
    and the model's build, once froze `kvfence up`'s conversion bar short of the end)."""
    engine = LocalProcess(
        ["serve", "--model", "builtin:smollm2-135m-instruct", "--kv-cache-memory", "16Mi",
         "--threads", "1"],
        env={"KVFENCE_CACHE_DIR": str(tmp_path / "cache")},  # empty: the weights are converted
        log_path=tmp_path / "engine.log",
    ).start()  # fmt: skip
    said: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                answer = httpx.get(engine.url + "/readyz", timeout=5)
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
                continue
            readiness = EngineReadiness.model_validate_json(answer.content)
            if readiness.status == "ready":
                break
            assert readiness.status == "loading", readiness
            if readiness.progress and readiness.progress.line not in said:
                said.append(readiness.progress.line)
            time.sleep(0.05)
        else:
            pytest.fail("not ready after 300s")
    finally:
        engine.stop()
    assert any(re.fullmatch(CONVERTING, line) for line in said), said
    log = (tmp_path / "engine.log").read_text()
    logged = [m.groups() for m in re.finditer(CONVERTING, log)]
    total = logged[-1][1]
    assert logged[-1] == (total, total), logged
    assert 10 <= len(logged) <= 11, logged  # a line every tenth of the way, not one per tensor
    assert "\r" not in log  # no bar drawn into a file
    steps = [m.groups() for m in re.finditer(LOADING, log)]
    assert steps == [(str(i), step) for i, step in enumerate(STEPS, 1)], steps
    tensors_at = [m.start() for m in re.finditer(CONVERTING, log)]  # within their step
    assert log.index(STEPS[1]) < tensors_at[0] and tensors_at[-1] < log.index(STEPS[2]), log
    assert any(re.fullmatch(LOADING, line) for line in said), said  # /readyz says the steps
