"""What the router shows a canary that can reach nothing else (the engines are fenced): every
backend's pool in GET /v1/kvpool, and every engine's isolation counters in its /metrics, with
an unreadable engine marked as such rather than read as zero. And what it does not show a
tenant (issue 12, finding 4): /metrics, backend addresses and ports, pool occupancy, and the
detail of a backend's failure."""

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from helpers.deployments import Deployment, start_deployment
from helpers.engines import prompt_of
from kvfence_engine.canary.counters import parse_counters
from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.disagg.transfer import Handle, Layout, Sender, TransferError, page_views
from kvfence_engine.loading.loader import TINY_CONFIG

KEY = "router-view-key"
TOKEN = "router-view-internal-token"
TENANT = {"Authorization": f"Bearer {KEY}"}
INTERNAL = {TOKEN_HEADER: TOKEN}
PAGE = 16


def views_deployment(
    logs_dir: Path, tmp_path_factory: pytest.TempPathFactory, name: str
) -> Deployment:
    folder = tmp_path_factory.mktemp(name)
    keys, token = folder / "keys", folder / "token"
    keys.write_text(f"{KEY} tenant\n")
    token.write_text(TOKEN + "\n")
    return start_deployment(
        logs_dir, name, decode_pages=48, router_args=["--api-keys", str(keys)], token_file=token
    )


@pytest.fixture(scope="module")
def deployment(logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = views_deployment(logs_dir, tmp_path_factory, "router-views")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def prefill_killed(
    logs_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """A deployment of its own whose prefill instance is killed: the tests that share
    `deployment` never see it dead, in whatever order and on whichever worker xdist runs them
    (it once ran the killing test first, and the next ones read a dead prefill)."""
    d = views_deployment(logs_dir, tmp_path_factory, "router-views-killed")
    d.prefills[0].kill()
    yield d
    d.stop()


def test_the_routers_kvpool_lists_every_backend_and_the_smallest_pool(
    deployment: Deployment,
) -> None:
    assert httpx.get(deployment.router.url + "/v1/kvpool").status_code == 401
    r = httpx.get(deployment.router.url + "/v1/kvpool", headers=INTERNAL)
    assert r.status_code == 200
    summary = r.json()
    assert summary["pool_tokens"] == 48 * PAGE  # decode's pool is the smaller one
    assert summary["context_length_effective"] == summary["context_length_served"] == 512
    assert summary["tag_check"] and summary["kv_checksum"] and summary["deferred_release"]
    backends = {(b["role"], b["url"]): b["report"]["pool_tokens"] for b in summary["backends"]}
    assert backends == {
        ("prefill", deployment.prefills[0].url): 64 * PAGE,
        ("decode", deployment.decodes[0].url): 48 * PAGE,
    }


def ports_in(text: str) -> set[str]:
    return set(re.findall(r"127\.0\.0\.1:(\d+)", text))


def test_a_tenant_sees_each_engines_pool_size_but_not_where_it_is_or_how_full(
    deployment: Deployment,
) -> None:
    r = httpx.get(deployment.router.url + "/v1/kvpool", headers=TENANT)
    assert r.status_code == 200
    summary = r.json()
    assert summary["pool_tokens"] == 48 * PAGE and summary["context_length_served"] == 512
    assert [(b["role"], b["report"]["pool_tokens"]) for b in summary["backends"]] == [
        ("prefill", 64 * PAGE),
        ("decode", 48 * PAGE),
    ]
    full = httpx.get(deployment.router.url + "/v1/kvpool", headers=INTERNAL).json()
    engine_ports = {str(full["backends"][1]["report"]["transfer_port"])} | {
        p.url.rsplit(":", 1)[1] for p in deployment.prefills + deployment.decodes
    }
    assert "http" not in r.text and "127.0.0.1" not in r.text
    assert not any(f":{port}" in r.text or f" {port}" in r.text for port in engine_ports)
    assert "free_pages" not in r.text and "transfer_port" not in r.text


def test_a_tenant_cannot_read_the_routers_metrics_and_the_operator_can(
    deployment: Deployment,
) -> None:
    assert (
        deployment.client(KEY)
        .completions.create(model="tiny-random", prompt="hi", max_tokens=2)
        .usage
    )
    r = httpx.get(deployment.router.url + "/metrics", headers=TENANT)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    bearer = {"Authorization": f"Bearer {TOKEN}"}  # how Prometheus scrapes
    assert 'tenant="tenant"' in httpx.get(deployment.router.url + "/metrics", headers=bearer).text


def test_the_engines_pool_and_metrics_need_the_internal_token(deployment: Deployment) -> None:
    for engine in (deployment.prefills[0], deployment.decodes[0]):
        for path in ("/v1/kvpool", "/metrics"):
            for headers in ({}, TENANT):
                assert httpx.get(engine.url + path, headers=headers).status_code == 401
            for headers in (INTERNAL, {"Authorization": f"Bearer {TOKEN}"}):
                assert httpx.get(engine.url + path, headers=headers).status_code == 200
        assert httpx.get(engine.url + "/readyz").json() == {"status": "ready"}


def test_an_overloaded_decodes_error_names_no_page_counts(deployment: Deployment) -> None:
    """Decode's own message says how many pages are free; the client's says nothing of it."""
    decode = deployment.decodes[0].url
    held = []
    try:
        for i in range(3):  # 3 x 256 tokens: all 48 pages of decode's pool
            r = httpx.post(
                decode + "/internal/reserve",
                json={"request_id": f"fill-{i}", "prompt_ids": prompt_of(256, seed=i)},
                headers=INTERNAL,
            )
            assert r.status_code == 200, r.text
            held.append(f"fill-{i}")
        r = httpx.post(
            deployment.router.url + "/v1/completions",
            json={"model": "tiny-random", "prompt": prompt_of(100), "max_tokens": 2},
            headers=TENANT,
        )
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "overloaded" and r.headers["retry-after"] == "1"
        assert not re.search(r"\d+ free|pages", error["message"]), error["message"]
    finally:
        for request_id in held:
            httpx.post(
                decode + "/internal/abort", json={"request_id": request_id}, headers=INTERNAL
            )


def short_transfer(decode_url: str) -> None:
    """Reserve 40 tokens on decode and deliver the KV of 16: decode's count check trips."""
    r = httpx.post(
        decode_url + "/internal/reserve",
        json={"request_id": "short", "prompt_ids": prompt_of(40)},
        headers=INTERNAL,
    )
    handle = r.json()
    handle.pop("max_tokens")
    layout = Layout(
        TINY_CONFIG.num_layers, PAGE, TINY_CONFIG.num_kv_heads, TINY_CONFIG.head_dim, "float32"
    )
    shape = (1, layout.layers, PAGE, layout.kv_heads, layout.head_dim)
    with Sender(Handle(**handle), layout, token=TOKEN) as sender:
        sender.send_pages(0, page_views(torch.randn(shape), torch.randn(shape)), [PAGE])
        with pytest.raises(TransferError):
            sender.finish(PAGE)
    httpx.post(decode_url + "/internal/abort", json={"request_id": "short"}, headers=INTERNAL)


def test_the_routers_metrics_carry_each_engines_isolation_counters(
    deployment: Deployment,
) -> None:
    decode, prefill = deployment.decodes[0].url, deployment.prefills[0].url
    before = parse_counters(httpx.get(deployment.router.url + "/metrics", headers=INTERNAL).text)
    assert before.unreadable == ()
    assert before.values[("kvfence_transfer_count_mismatch", f"decode {decode}")] == 0
    assert before.values[("kvfence_kv_tag_mismatch", f"prefill {prefill}")] == 0
    short_transfer(decode)
    text = httpx.get(deployment.router.url + "/metrics", headers=INTERNAL).text
    after = parse_counters(text)
    assert after.values[("kvfence_transfer_count_mismatch", f"decode {decode}")] == 1
    assert "# TYPE kvfence_router_requests_total counter" in text  # the router's own, still


def test_an_engine_the_router_cannot_read_is_reported_down_not_zero(
    prefill_killed: Deployment,
) -> None:
    deployment = prefill_killed
    after = parse_counters(httpx.get(deployment.router.url + "/metrics", headers=INTERNAL).text)
    assert after.unreadable == (f"prefill {deployment.prefills[0].url}",)
    assert all(source != f"prefill {deployment.prefills[0].url}" for _, source in after.values)
    r = httpx.get(deployment.router.url + "/v1/kvpool", headers=INTERNAL)
    assert r.status_code == 200
    gone = [b for b in r.json()["backends"] if b["role"] == "prefill"]
    assert gone == [
        {"role": "prefill", "url": deployment.prefills[0].url, "error": "unreachable or not ready"}
    ]
    r = httpx.get(deployment.router.url + "/v1/kvpool", headers=TENANT)
    gone = [b for b in r.json()["backends"] if b["role"] == "prefill"]
    assert gone == [{"role": "prefill", "report": None, "error": "unreachable or not ready"}]


def test_an_unreachable_backends_503_names_no_address(prefill_killed: Deployment) -> None:
    """With the prefill instance killed, decode reserves and prefill does not answer."""
    r = httpx.post(
        prefill_killed.router.url + "/v1/completions",
        json={"model": "tiny-random", "prompt": "hello", "max_tokens": 2},
        headers=TENANT,
    )
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] in ("backend_unreachable", "overloaded")
    assert "http" not in r.text and "127.0.0.1" not in r.text, r.text
