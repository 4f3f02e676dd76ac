"""Per-tenant limits through real processes: a tenant at its limit gets 429 with Retry-After
in the OpenAI shape while another tenant is served, and its count comes back when its answers
end, however they end.

The concurrency limit is the router's: its backends here are a stand-in
(helpers/slow_engine.py) whose answers to team-a never end until the router hangs up, so the
test decides how long requests stay in flight. The pool share is decode's: a real router,
prefill and decode."""

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from helpers import slow_engine
from helpers.deployments import Deployment, start_deployment
from helpers.engines import prompt_of
from helpers.processes import metric
from helpers.waits import READY_S
from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.tools.localproc import LocalProcess, free_port

TOKEN = "tenant-limits-internal-token"
KEYS = {"team-a": "key-a", "team-b": "key-b"}
CONCURRENT = 2
SETTLE_S = 10.0


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    here = tmp_path_factory.mktemp("tenant-limits")
    keys, token = here / "keys", here / "token"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    token.write_text(TOKEN)
    return keys, token


@pytest.fixture(scope="module")
def router(secrets: tuple[Path, Path], logs_dir: Path) -> Iterator[LocalProcess]:
    """A real router with --max-concurrent-per-tenant in front of backends that never finish
    team-a's answers."""
    keys, token = secrets
    port = free_port()
    with open(logs_dir / "slow-engine.log", "wb") as log:
        backend = subprocess.Popen(
            [sys.executable, slow_engine.__file__, str(port), "team-a"], stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    args = ["router", "--model", "builtin:tiny-random", "--context-length", "512"]
    args += ["--prefill", url, "--decode", url, "--api-keys", str(keys)]
    args += ["--internal-token-file", str(token)]
    args += ["--max-concurrent-per-tenant", str(CONCURRENT)]
    proc = LocalProcess(args, log_path=logs_dir / "tenant-limits-router.log")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/readyz").raise_for_status()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the stand-in backend did not start"
                time.sleep(0.1)
        proc.start().wait_ready(timeout=READY_S)
        yield proc
    finally:
        proc.stop()
        backend.terminate()
        backend.wait(timeout=10)


def completion(max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {"prompt": "tell me a long story", "max_tokens": max_tokens, "stream": stream}


def post(url: str, tenant: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        timeout=60,
    )


@contextmanager
def streaming(url: str, tenant: str) -> Iterator[None]:
    """A stream of `tenant` that has its first token and stays open (in flight) inside."""
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json=completion(100, stream=True),
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()[:500]
        lines = r.iter_lines()  # held: a dropped iterator closes the stream
        next(lines)
        yield


def inflight(url: str, tenant: str) -> float:
    return metric(url, f'kvfence_router_tenant_inflight{{tenant="{tenant}"}}', TOKEN)


def wait_inflight(url: str, tenant: str, count: int) -> None:
    deadline = time.monotonic() + SETTLE_S
    while inflight(url, tenant) != count:
        if time.monotonic() > deadline:
            pytest.fail(f"{tenant} has {inflight(url, tenant)} requests in flight, not {count}")
        time.sleep(0.05)


def assert_429(r: httpx.Response, type_: str, code: str) -> None:
    assert r.status_code == 429, r.text[:500]
    assert r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (type_, code)


def test_a_tenant_at_its_concurrent_limit_gets_429_while_another_is_served(
    router: LocalProcess,
) -> None:
    url = router.url
    with ExitStack() as open_streams:
        for _ in range(CONCURRENT):
            open_streams.enter_context(streaming(url, "team-a"))
        assert inflight(url, "team-a") == CONCURRENT
        over = post(url, "team-a", completion(2))
        assert_429(over, "requests", "tenant_limit")
        assert "in flight" in over.json()["error"]["message"]
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS["team-a"], max_retries=0)
        with pytest.raises(openai.RateLimitError):  # what the openai client makes of it
            client.completions.create(model="tiny-random", prompt="x", max_tokens=2)
        served = post(url, "team-b", completion(2))
        assert served.status_code == 200, served.text
        rejected = metric(url, 'kvfence_requests_rejected_total{reason="tenant_limit"}', TOKEN)
        assert rejected >= 2
        refused = metric(url, 'kvfence_router_requests_total{status="429",tenant="team-a"}', TOKEN)
        assert refused >= 2
    # the clients hung up mid-answer: their places come back
    wait_inflight(url, "team-a", 0)
    with streaming(url, "team-a"):
        assert inflight(url, "team-a") == 1
    wait_inflight(url, "team-a", 0)


def test_whole_answers_and_refused_requests_give_their_places_back(router: LocalProcess) -> None:
    url = router.url
    for _ in range(CONCURRENT + 1):
        assert post(url, "team-b", completion(2)).status_code == 200
        too_long = post(url, "team-b", {"prompt": prompt_of(600), "max_tokens": 2})
        assert too_long.status_code == 400, too_long.text[:500]
    assert inflight(url, "team-b") == 0


def test_the_inflight_metric_is_for_the_operator_not_tenants(router: LocalProcess) -> None:
    r = httpx.get(router.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['team-a']}"})
    assert r.status_code == 403


# --- decode's pool share, through a real router -----------------------------------------------

SHARE = 0.5  # of decode's 64 pages: 32 per tenant (512 tokens, the context)


@pytest.fixture(scope="module")
def deployment(secrets: tuple[Path, Path], logs_dir: Path) -> Iterator[Deployment]:
    keys, token = secrets
    d = start_deployment(
        logs_dir,
        "tenant-share",
        router_args=["--api-keys", str(keys)],
        engine_args=["--max-pool-share-per-tenant", str(SHARE)],
        token_file=token,
    )
    yield d
    d.stop()


def test_a_tenant_over_its_pool_share_on_decode_gets_429_while_another_gets_pages(
    deployment: Deployment,
) -> None:
    decode = deployment.decodes[0].url
    internal = {TOKEN_HEADER: TOKEN}
    # team-a's earlier request holds 20 of its 32 pages on decode (its KV not yet arrived)
    held = {
        "request_id": "team-a-held",
        "prompt_ids": prompt_of(100),
        "max_tokens": 220,
        "tenant": "team-a",
    }
    r = httpx.post(decode + "/internal/reserve", json=held, headers=internal)
    assert r.status_code == 200, r.text
    try:
        over = post(deployment.router.url, "team-a", completion(300))  # 19 more pages
        assert_429(over, "tokens", "tenant_pool_share")
        served = post(deployment.router.url, "team-b", completion(300))
        assert served.status_code == 200, served.text[:500]
        reserved = metric(decode, 'kvfence_tenant_kv_pages_reserved{tenant="team-a"}', TOKEN)
        assert reserved == 20
        fits = post(deployment.router.url, "team-a", completion(100))  # 7 more: within it
        assert fits.status_code == 200, fits.text[:500]
    finally:
        r = httpx.post(
            decode + "/internal/abort", json={"request_id": "team-a-held"}, headers=internal
        )
        assert r.json() == {"aborted": True}
