"""`kvfence` commands where a process is part of the test: run in a fresh interpreter (what
they import, what they print), or judged against a running engine."""

import os
import subprocess
import sys
from pathlib import Path

from helpers.deployments import Deployment
from helpers.engines import tiny_budget
from helpers.fuzzing import FUZZ_KEY
from helpers.waits import FACT_S
from kvfence_cli.main import main
from kvfence_engine.tools.localproc import free_port
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


def test_the_router_refuses_to_start_on_a_tenant_name_outside_the_request_id_pattern(
    tmp_path: Path,
) -> None:
    """Issue 12, finding 6: such a tenant got a 400 with internal validation detail on every
    request. Now the router does not start, and says which line of which file is wrong."""
    keys = tmp_path / "api-keys"
    keys.write_text("key-a tenant-a\nkey-x team/x\n")
    done = subprocess.run(
        [
            sys.executable, "-m", "kvfence_cli", "router",
            "--model", "builtin:tiny-random", "--port", "0", "--api-keys", str(keys),
            "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"kvfence router: {keys}:2: tenant 'team/x' is not a valid tenant name" in done.stderr
    assert "key-x" not in done.stderr


def test_the_operator_without_cluster_access_exits_at_once_saying_which_config_it_tried(
    tmp_path: Path,
) -> None:
    """Issue 18, item 12: it printed tracebacks and retried every 60 s instead."""
    missing = tmp_path / "no-such-kubeconfig"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(missing), HOME=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "operator", "--standalone"],
        capture_output=True,
        text=True,
        timeout=FACT_S,  # a hang guard
        env=env,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfence operator: "), done.stderr
    assert str(missing) in lines[0] and "KUBECONFIG" in lines[0]
    assert "service account" in lines[0]  # the in-cluster config it tried too


def _preflight(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "preflight", "--context-length", "256", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_preflight_reads_the_router_url_with_an_api_key_however_the_url_is_written(
    fuzz_deployment: Deployment,
) -> None:
    """Issue 18, item 7: the router URL `kvfence up` prints gave a raw 401 (no way to pass a
    key), and a URL without http:// or ending in /v1 failed oddly."""
    url = fuzz_deployment.router.url
    bare = url.removeprefix("http://")
    for target in (url, bare, f"{url}/", f"{url}/v1", f"{bare}/v1/"):
        done = _preflight("--target", target, "--api-key", FUZZ_KEY)
        assert done.returncode == 0, (target, done.stderr)
        assert f"target {url}: router over 2 engines" in done.stdout, done.stdout
        assert "context 256: fits" in done.stdout
        assert "HTTP Request" not in done.stderr + done.stdout  # httpx's INFO lines
    from_env = _preflight("--target", bare, env={"KVFENCE_API_KEY": FUZZ_KEY})
    assert from_env.returncode == 0, from_env.stderr


def test_preflight_without_the_routers_api_key_says_one_is_needed(
    fuzz_deployment: Deployment,
) -> None:
    url = fuzz_deployment.router.url
    done = _preflight("--target", url + "/v1", env={"KVFENCE_API_KEY": ""})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"kvfence preflight: {url}/v1/kvpool answered 401: an API key is needed "
        "(--api-key or $KVFENCE_API_KEY)"
    ]
    wrong = _preflight("--target", url, "--api-key", "not-a-key")
    assert wrong.returncode == 2
    assert wrong.stderr.splitlines() == [
        f"kvfence preflight: {url}/v1/kvpool answered 401: the API key was refused"
    ]


def test_preflight_against_nothing_listening_names_the_url_in_one_line() -> None:
    done = _preflight("--target", "127.0.0.1:9")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("kvfence preflight: cannot reach http://127.0.0.1:9/v1/kvpool: ")


def test_the_canary_reads_target_as_preflight_does() -> None:
    """One meaning for --target: a running kvfence server's URL, written as people paste it."""
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "canary", "--target", f"127.0.0.1:{port}/v1/",
         "--tenant-a-key", "a", "--tenant-b-key", "b"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"cannot reach the target at http://127.0.0.1:{port}/v1/models:" in done.stdout


def test_kvfence_alone_prints_its_help_as_git_and_kubectl_do() -> None:
    """Issue 18, item 8: it printed an argparse error instead."""
    done = subprocess.run(
        [sys.executable, "-m", "kvfence_cli"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: kvfence")
    assert "kvfence up examples/smollm2-local.yaml" in done.stdout
    assert done.stderr == ""


def test_kvfence_version_is_the_installed_package_version() -> None:
    from importlib.metadata import version

    done = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvfence {version('kvfence')}\n"
