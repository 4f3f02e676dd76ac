"""bench/prefix_cache.py with tiny settings (builtin:tiny-random, 2 tenants x 2 turns), so it
cannot rot: it starts both deployments, runs the conversations and the cross-tenant probes,
says whether the cache is on as the prefill engines report it, and ends with its summary line.
The numbers are the benchmark's business; here only cross_tenant_hits must be 0."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "prefix_cache.py"
LAST = re.compile(
    r"ttft_p50_cold_ms=(\d+) ttft_p50_cached_ms=(\d+) speedup=([\d.]+)x "
    r"cross_tenant_hits=(\d+) prefix_cache=(on|off)"
)
TINY = ["--model", "builtin:tiny-random", "--tenants", "2", "--turns", "2", "--rounds", "1"]
TINY += ["--system-tokens", "48", "--max-tokens", "2", "--kv-cache-memory", "8Mi"]


def test_the_benchmark_runs_and_reports_no_cross_tenant_hits() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY], capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    last = LAST.fullmatch(lines[-1])
    assert last, lines[-1]
    assert last.group(4) == "0"
    assert "FAILED" not in done.stdout
    # Whether the cache ran is what the prefill engines said, and the report says the same.
    state = last.group(5)
    assert ("prefix cache: on" in done.stdout) == (state == "on")
    assert ("prefix cache: OFF" in done.stdout) == (state == "off")
    own = re.search(r"^own cached tokens\s+(\d+)\s+(\d+)$", done.stdout, re.M)
    assert own, done.stdout
    assert own.group(1) == "0"  # the deployment without the cache never reports a hit
    if state == "on":  # each tenant's second turn repeats its first turn's full pages
        assert int(own.group(2)) > 0, done.stdout


def test_too_few_tenants_or_turns_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tenants", "1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "prefix_cache: need at least 2 tenants, 2 turns and 1 round"
