"""The canary passes a healthy disaggregated SmolLM2 deployment (router + prefill + decode
processes) in well under five minutes, with its latency floor judging real prefills."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import serve
from deployments import Deployment
from kvfence_engine.canary import CanaryConfig, run_canary
from kvfence_engine.localproc import LocalProcess

pytestmark = pytest.mark.slow
SMOLLM2 = "builtin:smollm2-135m-instruct"
CONTEXT = 256  # a 256-token SmolLM2 prefill takes ~1 s here: long enough to judge, short to run
KV_MEMORY = "24Mi"  # 34 pages of 16: a pool of twice the context


@pytest.fixture(scope="module")
def smollm2(logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    keys = tmp_path_factory.mktemp("canary-smollm2") / "keys"
    keys.write_text("key-a tenant-a\nkey-b tenant-b\n")
    common = ["--model", SMOLLM2, "--context-length", str(CONTEXT)]
    common += ["--kv-cache-memory", KV_MEMORY, "--transfer-port", "0"]
    prefill = serve(logs_dir, "canary-smollm2-prefill", "--role", "prefill", *common)
    decode = serve(logs_dir, "canary-smollm2-decode", "--role", "decode", *common)
    backends = ["--prefill", prefill.url, "--decode", decode.url]
    router = LocalProcess(
        ["router", "--model", SMOLLM2, "--api-keys", str(keys), *backends],
        log_path=logs_dir / "canary-smollm2-router.log",
    )
    d = Deployment(router, [prefill], [decode])
    try:
        for proc in d.all:
            proc.start()
        for proc in d.all:
            proc.wait_ready(timeout=240)
        yield d
    finally:
        d.stop()


def test_a_healthy_smollm2_deployment_passes_the_canary(smollm2: Deployment) -> None:
    report = run_canary(CanaryConfig(smollm2.router.url, "key-a", "key-b"))
    print(report.human())
    assert report.exit_code == 0, report.reason
    checks = {c.name: c for c in report.checks}
    assert checks["latency_floor"].inputs["answers_judged"] > 0
    assert report.facts is not None and report.facts["model"] == "smollm2-135m-instruct"
    assert report.seconds < 300
