"""The metrics token (--metrics-token-sha256): what Prometheus presents to scrape engines and
routers. It opens /metrics and nothing else: not the pool report, not the internal endpoints,
not the router's operator views."""

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.deployments import Deployment, start_deployment

INTERNAL, METRICS, TENANT_KEY = "internal-s3cret", "metrics-s3cret", "key-a"


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def scraped(logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    files = tmp_path_factory.mktemp("metrics-token")
    (files / "internal").write_text(INTERNAL + "\n")
    (files / "keys").write_text(f"{TENANT_KEY} tenant-a\n")
    metrics_flag = ["--metrics-token-sha256", sha256(METRICS)]
    d = start_deployment(
        logs_dir,
        "metrics-token",
        token_file=files / "internal",
        engine_args=metrics_flag,
        router_args=["--api-keys", str(files / "keys"), *metrics_flag],
    )
    yield d
    d.stop()


def test_an_engine_answers_metrics_to_the_metrics_token_and_nothing_else(
    scraped: Deployment,
) -> None:
    for engine in (scraped.prefills[0], scraped.decodes[0]):
        r = httpx.get(engine.url + "/metrics", headers=bearer(METRICS))
        assert r.status_code == 200 and "kvfence_kv_pages_used" in r.text
        assert httpx.get(engine.url + "/metrics", headers=bearer(INTERNAL)).status_code == 200
        assert httpx.get(engine.url + "/metrics", headers=bearer("wrong")).status_code == 401
        assert httpx.get(engine.url + "/v1/kvpool", headers=bearer(METRICS)).status_code == 401
        r = httpx.get(engine.url + "/internal/v1/tokenizer", headers=bearer(METRICS))
        assert r.status_code == 401
    body = {"request_id": "scraper", "prompt_ids": [1, 2, 3]}
    for headers in (bearer(METRICS), {"X-Kvfence-Internal-Token": METRICS}):
        r = httpx.post(scraped.decodes[0].url + "/internal/reserve", json=body, headers=headers)
        assert r.status_code == 401


def test_a_router_answers_metrics_to_the_metrics_token_but_no_operator_view(
    scraped: Deployment,
) -> None:
    done = scraped.client(TENANT_KEY).completions.create(
        model="tiny-random", prompt="hi", max_tokens=2
    )
    assert done.usage is not None and done.usage.completion_tokens == 2
    r = httpx.get(scraped.router.url + "/metrics", headers=bearer(METRICS))
    assert r.status_code == 200 and 'tenant="tenant-a"' in r.text
    assert "kvfence_backend_up" in r.text
    assert httpx.get(scraped.router.url + "/metrics", headers=bearer("wrong")).status_code == 401
    for path in ("/v1/kvpool", "/internal/v1/backends"):
        assert httpx.get(scraped.router.url + path, headers=bearer(METRICS)).status_code == 401
    with pytest.raises(Exception, match="401"):
        scraped.client(METRICS).completions.create(model="tiny-random", prompt="hi", max_tokens=2)


@pytest.mark.parametrize("command", ["serve", "router"])
def test_a_metrics_token_without_an_internal_token_is_refused_in_one_line(
    command: str,
) -> None:
    args = ["--model", "builtin:tiny-random", "--port", "0", "--metrics-token-sha256", sha256("x")]
    if command == "router":
        args += ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
    done = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", command, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"kvfence {command}: --metrics-token-sha256 needs --internal-token-file "
        "(without an internal token /metrics is open to everyone)"
    )


def test_a_metrics_token_digest_that_is_no_sha256_is_refused_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "serve", "--metrics-token-sha256", "s3cret"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "kvfence serve: error: argument --metrics-token-sha256: "
        "must be 64 hex digits (a SHA-256), got 's3cret'"
    )
