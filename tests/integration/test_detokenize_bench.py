"""bench/detokenize.py with short settings, so it cannot rot: it names the CPU and ends with
its summary line. The cost ratio itself is tested in tests/unit/engine/test_detokenizer.py;
here only that the detokenizer's per-token cost grows far less than re-decoding's."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "detokenize.py"
LAST = re.compile(
    r"cpu=(\w+) us_per_token_500=([\d.]+) us_per_token_4000=([\d.]+) ratio=([\d.]+)x "
    r"whole_redecode_ratio=([\d.]+)x"
)


def test_the_benchmark_runs_and_names_the_cpu() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--lengths", "500", "4000", "--repeats", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    last = LAST.fullmatch(done.stdout.strip().splitlines()[-1])
    assert last, done.stdout
    assert last.group(1) in done.stdout.splitlines()[0]
    assert float(last.group(4)) < float(last.group(5))
