"""A tenant's GET /v1/kvpool is no fan-out it can turn on the backends (issue 33, finding 7):
however often tenants ask, the router reads its backends' pools at most once a second for them
(the view is the same for every tenant), and each request counts in the tenant's requests in
flight like a completion. The operator's view is read at every request."""

from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from kvfence_engine.contracts import TOKEN_HEADER, KvPoolReport, Role
from kvfence_engine.loading.tokenizer_source import TINY_RANDOM, load_tokenizer
from kvfence_engine.router.app import create_router_app
from kvfence_engine.router.backends import Backends
from kvfence_engine.router.keys import ApiKeys
from kvfence_engine.router.recent import Recent
from kvfence_engine.router.state import TENANT_VIEW_SECONDS, RouterState
from kvfence_engine.router.tenants import TenantInflight

TOKEN = "internal-" + "t" * 32
KEY = "tenant-key-" + "k" * 32
PREFILL, DECODE = "http://127.0.0.1:9", "http://127.0.0.2:9"  # answered by MockTransport


def report(role: Role) -> KvPoolReport:
    return KvPoolReport(
        role=role, revision="r1", pool_tokens=1024, page_size=16, num_pages=64, free_pages=60,
        kv_bytes_per_token=768, kv_dtype="float32", weight_dtype="float32",
        context_length_requested=512, context_length_effective=512, context_policy="refuse",
        model_max_positions=4096, tag_check=True, kv_checksum=True,
        transfer_port=8001 if role is Role.DECODE else None, deferred_release=True,
        scrub_on_free=False, unsafe_faults=[],
    )  # fmt: skip


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


Routed = tuple[TestClient, RouterState, list[str], Clock]


@pytest.fixture
def routed(tmp_path: Path) -> Routed:
    (tmp_path / "keys").write_text(f"{KEY} tenant-a\n")
    calls: list[str] = []

    def backend(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        role = Role.PREFILL if request.url.host == "127.0.0.1" else Role.DECODE
        return httpx.Response(200, content=report(role).model_dump_json())

    _, tokenizer = load_tokenizer(TINY_RANDOM)
    state = RouterState(
        "tiny", tokenizer, Backends.create([PREFILL], [DECODE], None),
        ApiKeys.load([str(tmp_path / "keys")]), TOKEN, 512,
        client=httpx.AsyncClient(transport=httpx.MockTransport(backend)),
        inflight=TenantInflight(limit=1),
    )  # fmt: skip
    clock = Clock()
    state.tenant_pools = Recent(TENANT_VIEW_SECONDS, clock)
    return TestClient(create_router_app(state)), state, calls, clock


TENANT = {"Authorization": f"Bearer {KEY}"}


def test_a_flood_of_tenant_pool_views_reads_the_backends_once_a_second(routed: Routed) -> None:
    client, _, calls, clock = routed
    for _ in range(50):
        r = client.get("/v1/kvpool", headers=TENANT)
        assert r.status_code == 200, r.text
        assert "free_pages" not in r.text and "127.0.0" not in r.text
    assert len(calls) == 2, calls  # one read of each backend for fifty requests
    clock.now += TENANT_VIEW_SECONDS
    assert client.get("/v1/kvpool", headers=TENANT).status_code == 200
    assert len(calls) == 4, "a second later the view is read again"


def test_the_operators_view_is_read_at_every_request(routed: Routed) -> None:
    client, _, calls, _ = routed
    for _ in range(3):
        r = client.get("/v1/kvpool", headers={TOKEN_HEADER: TOKEN})
        assert r.status_code == 200 and "free_pages" in r.text, r.text
    assert len(calls) == 6


def test_a_tenant_pool_view_counts_in_the_tenants_requests_in_flight(routed: Routed) -> None:
    client, state, calls, _ = routed
    held = state.inflight.enter("tenant-a")  # the tenant's one request in flight
    try:
        r = client.get("/v1/kvpool", headers=TENANT)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "tenant_limit" and "retry-after" in r.headers
        assert calls == []
    finally:
        held.release()
    assert client.get("/v1/kvpool", headers=TENANT).status_code == 200
    assert state.inflight.counts["tenant-a"] == 0, "released when answered"
    assert client.get("/v1/kvpool").status_code == 401
