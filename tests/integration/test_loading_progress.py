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


@pytest.mark.slow
def test_weight_conversion_shows_on_readyz_and_as_plain_lines_in_the_log(tmp_path: Path) -> None:
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
