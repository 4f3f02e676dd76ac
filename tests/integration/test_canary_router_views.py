"""What the router shows a canary that can reach nothing else (the engines are fenced): every
backend's pool in GET /v1/kvpool, and every engine's isolation counters in its /metrics, with
an unreadable engine marked as such rather than read as zero."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from helpers.deployments import Deployment, start_deployment
from helpers.engines import prompt_of
from kvfence_engine.canary.counters import parse_counters
from kvfence_engine.disagg.transfer import Handle, Layout, Sender, TransferError, page_views
from kvfence_engine.loading.loader import TINY_CONFIG

KEY = "router-view-key"
PAGE = 16


@pytest.fixture(scope="module")
def deployment(logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    keys = tmp_path_factory.mktemp("router-views") / "keys"
    keys.write_text(f"{KEY} tenant\n")
    d = start_deployment(
        logs_dir, "router-views", decode_pages=48, router_args=["--api-keys", str(keys)]
    )
    yield d
    d.stop()


def test_the_routers_kvpool_lists_every_backend_and_the_smallest_pool(
    deployment: Deployment,
) -> None:
    assert httpx.get(deployment.router.url + "/v1/kvpool").status_code == 401
    r = httpx.get(deployment.router.url + "/v1/kvpool", headers={"Authorization": f"Bearer {KEY}"})
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


def short_transfer(decode_url: str) -> None:
    """Reserve 40 tokens on decode and deliver the KV of 16: decode's count check trips."""
    r = httpx.post(
        decode_url + "/internal/reserve", json={"request_id": "short", "prompt_ids": prompt_of(40)}
    )
    handle = r.json()
    handle.pop("max_tokens")
    layout = Layout(
        TINY_CONFIG.num_layers, PAGE, TINY_CONFIG.num_kv_heads, TINY_CONFIG.head_dim, "float32"
    )
    shape = (1, layout.layers, PAGE, layout.kv_heads, layout.head_dim)
    with Sender(Handle(**handle), layout, token=None) as sender:
        sender.send_pages(0, page_views(torch.randn(shape), torch.randn(shape)), [PAGE])
        with pytest.raises(TransferError):
            sender.finish(PAGE)
    httpx.post(decode_url + "/internal/abort", json={"request_id": "short"})


def test_the_routers_metrics_carry_each_engines_isolation_counters(
    deployment: Deployment,
) -> None:
    decode, prefill = deployment.decodes[0].url, deployment.prefills[0].url
    before = parse_counters(httpx.get(deployment.router.url + "/metrics").text)
    assert before.unreadable == ()
    assert before.values[("kvfence_transfer_count_mismatch", f"decode {decode}")] == 0
    assert before.values[("kvfence_kv_tag_mismatch", f"prefill {prefill}")] == 0
    short_transfer(decode)
    text = httpx.get(deployment.router.url + "/metrics").text
    after = parse_counters(text)
    assert after.values[("kvfence_transfer_count_mismatch", f"decode {decode}")] == 1
    assert "# TYPE kvfence_router_requests_total counter" in text  # the router's own, still


def test_an_engine_the_router_cannot_read_is_reported_down_not_zero(
    deployment: Deployment,
) -> None:  # last in this module: it kills the prefill instance
    deployment.prefills[0].kill()
    after = parse_counters(httpx.get(deployment.router.url + "/metrics").text)
    assert after.unreadable == (f"prefill {deployment.prefills[0].url}",)
    assert all(source != f"prefill {deployment.prefills[0].url}" for _, source in after.values)
    r = httpx.get(deployment.router.url + "/v1/kvpool", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    gone = [b for b in r.json()["backends"] if b["role"] == "prefill"]
    assert gone == [
        {"role": "prefill", "url": deployment.prefills[0].url, "error": "unreachable or not ready"}
    ]
