"""`kvfence` commands where a process is part of the test: run in a fresh interpreter (what
they import, what they print), or judged against a running engine."""

import subprocess
import sys
from pathlib import Path

from helpers.engines import tiny_budget
from kvfence_cli.main import main
from kvfence_operator.crd.schema import CRD_PATH

REPO = Path(__file__).resolve().parents[2]


def test_the_canary_does_not_import_torch() -> None:
    code = "import sys, kvfence_engine.canary, kvfence_cli.main; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kvfence_crd_prints_the_committed_yaml():
    out = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "crd"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out == (REPO / CRD_PATH).read_text()


def test_preflight_estimate_equals_the_pool_a_running_engine_allocates(tiny_server, capsys):
    """tiny_server runs with a 64-page budget: the estimate and the live report agree."""
    code = main(
        [
            "preflight",
            "--model", "builtin:tiny-random",
            "--kv-cache-memory", str(tiny_budget(64)),
            "--context-length", "512",
            "--target", tiny_server.url,
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "64 pages x 16 tokens = 1024 tokens per engine" in out
    assert "64 pages x 16 tokens = 1024 tokens (" in out  # the live report
    assert out.count("context 512: fits") == 2
