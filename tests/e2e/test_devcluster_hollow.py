"""Hollow pods (kvfence_devcluster/hollow.py, `KubeletOptions(hollow=True)`): small stand-ins
for `kvfence serve|router|canary` that answer what the operator and the kubelet ask, read by
the operator's own clients (pool_gate.read_pool, router_push.push_backends), and the operator
taking a hollow InferenceDeployment to Ready through bench/operator_scale.py."""

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.waits import READY_S, GiveUp, eventually
from kvfence_devcluster.hollow import HOLLOW_SCRIPT
from kvfence_devcluster.processes import ManagedProcess
from kvfence_engine.contracts import TOKEN_HEADER, BackendsFile, BackendsInForce, EngineReadiness
from kvfence_engine.tools.localproc import free_port
from kvfence_operator.cluster.prober import read_pool
from kvfence_operator.cluster.router_push import BACKENDS_PATH, push_backends

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "internal-token-0123456789"
HOLLOW = [sys.executable, "-P", HOLLOW_SCRIPT]


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def serving(tmp_path: Path, name: str, args: list[str]) -> Iterator[str]:
    port = free_port()
    process = ManagedProcess([*HOLLOW, *args, "--port", str(port)], tmp_path / f"{name}.log")
    with process:
        url = f"http://127.0.0.1:{port}"

        def healthz() -> int:
            if process.poll() is not None:
                raise GiveUp(f"it exited {process.poll()}:\n{process.log()}")
            return httpx.get(url + "/healthz", timeout=1).status_code

        eventually(healthz, f"the hollow {name} to answer", READY_S, until=lambda c: c == 200)
        yield url


@pytest.fixture
def decode(tmp_path: Path, token_file: Path) -> Iterator[str]:
    # the operator's flags for a decode pod (engine_deployment.engine_args), kvfence's name
    # swapped for the hollow module's
    args = [
        "serve", "--threads", "1", "--role", "decode", "--model", "builtin:tiny-random",
        "--host", "127.0.0.1", "--transfer-port", "9100", "--context-length", "1024",
        "--context-policy", "refuse", "--drain-seconds", "5",
        "--kv-cache-memory", str(96 * 16 * 768), "--page-size", "16", "--revision", "r1",
        "--device", "cpu", "--internal-token-file", str(token_file),
        "--termination-log", str(tmp_path / "engine-termination"),
    ]  # fmt: skip
    yield from serving(tmp_path, "decode", args)


def test_a_hollow_engine_reports_its_role_revision_and_pool_to_the_operators_probe(
    decode: str,
) -> None:
    ready = httpx.get(decode + "/readyz")
    assert ready.status_code == 200
    assert EngineReadiness.model_validate_json(ready.content).status == "ready"

    pool = read_pool("pod-a", "decode", "r1", decode, TOKEN)
    assert pool.error is None and pool.report is not None
    # 96 pages of 16 tokens at tiny-random's 768 bytes per token, as a real engine's pool
    assert (pool.report.pool_tokens, pool.report.num_pages) == (1536, 96)
    assert pool.report.context_length_effective == 1024
    assert pool.report.tag_check and pool.report.deferred_release
    assert pool.report.unsafe_faults == []

    assert read_pool("pod-a", "decode", "r2", decode, TOKEN).error == (
        "/v1/kvpool reports role 'decode' revision 'r1', expected 'decode' 'r2'"
    )
    assert read_pool("pod-a", "decode", "r1", decode, None).error == "/v1/kvpool answered 401"
    assert read_pool("pod-a", "decode", "r1", decode, "wrong").error == "/v1/kvpool answered 401"


def test_a_hollow_engine_whose_budget_holds_no_page_exits_1_with_the_reason(
    tmp_path: Path,
) -> None:
    log = tmp_path / "termination"
    done = subprocess.run(
        [*HOLLOW, "serve", "--role", "prefill", "--revision", "r1", "--kv-cache-memory", "100",
         "--termination-log", str(log)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "KV budget of 100 bytes holds no page" in log.read_text()


def test_a_hollow_router_takes_the_operators_pushes_newest_first(
    tmp_path: Path, token_file: Path
) -> None:
    written = BackendsFile(version=5, revision="r1", decode=["http://127.0.0.1:1"])
    backends = tmp_path / "backends.json"
    backends.write_text(written.file_text())
    args = [
        "router", "--host", "127.0.0.1", "--backends-file", str(backends),
        "--api-keys", "/nonexistent", "--internal-token-file", str(token_file),
    ]  # fmt: skip
    for url in serving(tmp_path, "router", args):
        assert httpx.get(url + "/readyz").status_code == 200
        assert httpx.get(url + BACKENDS_PATH).status_code == 401
        held = httpx.get(url + BACKENDS_PATH, headers={TOKEN_HEADER: TOKEN})
        assert BackendsInForce.model_validate_json(held.content) == BackendsInForce(
            source="file", digest=written.digest(), backends=written
        )

        newer = written.model_copy(update={"version": 6, "prefill": ["http://127.0.0.1:2"]})
        push_backends([url], newer, TOKEN)
        held = httpx.get(url + BACKENDS_PATH, headers={TOKEN_HEADER: TOKEN})
        in_force = BackendsInForce.model_validate_json(held.content)
        assert (in_force.source, in_force.digest) == ("push", newer.digest())

        stale = httpx.put(
            url + BACKENDS_PATH,
            headers={TOKEN_HEADER: TOKEN},
            json=written.model_dump(mode="json", by_alias=True),
        )
        assert stale.status_code == 409
        assert stale.json()["error"]["code"] == "stale_backends"
        garbage = httpx.put(url + BACKENDS_PATH, headers={TOKEN_HEADER: TOKEN}, json={"x": 1})
        assert garbage.status_code == 422


def hollow_canary(tmp_path: Path, *flags: str) -> tuple[int, str]:
    """A hollow canary's exit code and termination message."""
    log = tmp_path / "termination"
    done = subprocess.run(
        [*HOLLOW, "canary", "--target", "http://router:8000", "--termination-log", str(log),
         *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return done.returncode, log.read_text()


def test_a_hollow_canary_passes_and_says_it_checked_nothing(tmp_path: Path) -> None:
    code, summary = hollow_canary(tmp_path)
    assert code == 0
    assert summary.startswith("kvfence canary PASS: hollow pod of the test kubelet (no engine)")
    assert "nothing checked" in summary


@pytest.mark.parametrize(
    ("verdict", "code", "head"),
    [("fail", 1, "kvfence canary FAIL: "), ("cannot-run", 2, "kvfence canary ERROR: ")],
)
def test_a_hollow_canary_gives_the_verdict_a_test_asks_for_and_says_so(
    tmp_path: Path, verdict: str, code: int, head: str
) -> None:
    """The exit codes the canary Job's podFailurePolicy tells apart: 1 a finding, 2 no verdict."""
    assert hollow_canary(tmp_path, "--hollow-verdict", verdict) == (
        code,
        f"{head}hollow pod of the test kubelet (no engine): "
        + ("failed as the test asked" if verdict == "fail" else "could not run, as the test asked")
        + f" (--hollow-verdict {verdict}); nothing checked (a test of the operator, not of the "
        "engines)",
    )


def test_a_hollow_canary_holds_its_verdict_until_its_file_exists(tmp_path: Path) -> None:
    release = tmp_path / "release"
    args = [*HOLLOW, "canary", "--hollow-wait-for", str(release)]
    canary = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            canary.wait(1.0)  # it holds while the file is absent
        release.touch()
        assert canary.wait(30) == 0
    finally:
        canary.kill()


def test_the_real_canary_refuses_the_hollow_only_flags(tmp_path: Path) -> None:
    """A test that forgot `hollow=True` fails at once instead of testing a stand-in."""
    done = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "canary", "--target", "http://127.0.0.1:1",
         "--tenant-a-key", "a", "--tenant-b-key", "b", "--hollow-verdict", "fail"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "unrecognized arguments: --hollow-verdict fail" in done.stderr, done.stderr


def test_a_hollow_engine_reports_the_unsafe_faults_it_was_given(tmp_path, token_file) -> None:
    args = [
        "serve", "--role", "decode", "--revision", "r1", "--kv-cache-memory", str(96 * 16 * 768),
        "--internal-token-file", str(token_file),
        "--unsafe-fault", "no-tag-check", "--unsafe-fault", "early-release",
    ]  # fmt: skip
    for url in serving(tmp_path, "faulty", args):
        pool = read_pool("pod-a", "decode", "r1", url, TOKEN)
        assert pool.report is not None
        assert pool.report.unsafe_faults == ["early-release", "no-tag-check"]
        assert pool.report.tag_check is False
        assert pool.report.pool_tokens == 1536


def test_the_scale_bench_takes_hollow_deployments_to_ready_and_counts_the_operators_requests(
    tmp_path: Path,
) -> None:
    """bench/operator_scale.py's machinery at N=2 with a short window, so it cannot rot."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "operator_scale.py"), "--objects", "2",
         "--window", "5", "--settle", "1"],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    last = dict(field.split("=") for field in lines[-1].split())
    assert last["objects"] == "2"
    assert 0 < float(last["ready_seconds"]) < 400
    # a steady operator asks almost nothing (docs/operator.md, API load): at most the target
    assert 0 <= float(last["requests_per_object_per_minute"]) <= 12
    # the operator's 2 x (prefill, decode, router, canary) at least, none of them a real engine
    head = lines[0].split()
    assert head[0] == "objects=2:" and int(head[1]) >= 8, lines[0]
    assert "containers started, all hollow; API requests per object per minute over 5 s" in lines[0]
    # the breakdown by verb and resource adds up to the figure (a steady operator may ask
    # nothing at all in 5 s: then there is no row, and the user agents are "none")
    rows = [line.split() for line in lines[1:-3]]
    assert sum(float(row[0]) for row in rows) == pytest.approx(
        float(last["requests_per_object_per_minute"]), abs=0.1 * max(1, len(rows))
    )
    assert lines[-3].startswith("  by user agent: ")
    assert lines[-2].startswith("  in all: ") and " requests in 5 s, " in lines[-2]


def test_the_devcluster_command_runs_hollow_pods_with_hollow(tmp_path: Path) -> None:
    """`kvfence-devcluster --hollow`: what the bench does, for a person with kubectl."""
    kubeconfig = tmp_path / "kubeconfig"
    command = subprocess.Popen(
        [sys.executable, "-m", "kvfence_devcluster", "--kubeconfig", str(kubeconfig),
         "--state-dir", str(tmp_path / "state"), "--operator", "--install-crds", "--hollow"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert command.stdout is not None
    stdout = command.stdout

    def pump() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        first = lines.get(timeout=120)  # the operator runs by then
        assert "; hollow pods (stand-ins, no engines); use it with: export KUBECONFIG=" in first

        def kubectl(*args: str, stdin: str | None = None) -> str:
            done = subprocess.run(
                ["kubectl", "--kubeconfig", str(kubeconfig), *args],
                input=stdin, capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            return done.stdout

        sys.path.insert(0, str(ROOT / "bench"))
        try:
            from operator_scale import keys_secret, manifest
        finally:
            sys.path.remove(str(ROOT / "bench"))
        kubectl("apply", "-f", "-", stdin=json.dumps(keys_secret("hollow")))
        kubectl("apply", "-f", "-", stdin=json.dumps(manifest("hollow")))
        kubectl("wait", "--for=condition=Ready", "infd/hollow", "--timeout=150s")
        (decode,) = kubectl("get", "pods", "-l", "kvfence.dev/role=decode", "-o", "name").split()
        log = kubectl("logs", decode)
        assert "hollow pod of the test kubelet (no engine)" in log
        assert f"{HOLLOW_SCRIPT} serve --threads 1 --role decode" in log
    finally:
        command.terminate()
        assert command.wait(60) == 0
