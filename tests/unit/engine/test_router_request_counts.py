"""The router's `kvfence_router_requests_total{tenant,status}` counts every answer of its API
(issue 34, item 6), not only the 200s: refusals of every kind, by the tenant whose key came
with the request, and requests without a known key under one fixed label, so that the label
set stays bounded by the keys file and the status codes (an unknown key never becomes a
label)."""

from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from helpers.router_app import CHAT, KEY_A, KEY_B, TOKEN, bearer, router
from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.router.request_counts import OPERATOR, UNAUTHENTICATED


def counts(client: TestClient) -> dict[tuple[str, str], float]:
    r = client.get("/metrics", headers={TOKEN_HEADER: TOKEN})
    assert r.status_code == 200, r.text
    return {
        (s.labels["tenant"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(r.text)
        if family.name == "kvfence_router_requests"
        for s in family.samples
        if s.name == "kvfence_router_requests_total"
    }


def test_every_answer_is_counted_by_tenant_and_status(tmp_path: Path) -> None:
    client = router(tmp_path)
    answers = [
        client.get("/v1/models", headers=bearer(KEY_A)),
        client.post("/v1/chat/completions", json=CHAT | {"max_tokns": 2}, headers=bearer(KEY_A)),
        client.post("/v1/chat/completions", json=CHAT | {"model": "gpt-4"}, headers=bearer(KEY_A)),
        client.post("/v1/chat/completions", json=CHAT, headers=bearer(KEY_A)),
        client.post(
            "/v1/completions", json={"prompt": "x" * 8192}, headers=bearer(KEY_B)
        ),  # over the body cap: refused before any handler runs
        client.get("/v1/models", headers=bearer(KEY_B)),
        client.get("/v1/models", headers=bearer("not-a-key")),
        client.post("/v1/chat/completions", json=CHAT),
    ]
    assert [r.status_code for r in answers] == [200, 400, 404, 503, 413, 200, 401, 401]
    client.get("/healthz")  # probes and the operator's endpoints are no tenant's requests
    client.get("/readyz")
    assert counts(client) == {
        ("tenant-a", "200"): 1,
        ("tenant-a", "400"): 1,
        ("tenant-a", "404"): 1,
        ("tenant-a", "503"): 1,
        ("tenant-b", "413"): 1,
        ("tenant-b", "200"): 1,
        (UNAUTHENTICATED, "401"): 2,
    }


def test_an_unknown_key_is_never_a_label(tmp_path: Path) -> None:
    client = router(tmp_path)
    client.get("/v1/models", headers=bearer("tenant-a"))  # a tenant's name is not its key
    r = client.get("/metrics", headers={TOKEN_HEADER: TOKEN})
    assert 'tenant="tenant-a"' not in r.text
    assert counts(client) == {(UNAUTHENTICATED, "401"): 1}


def test_without_keys_every_request_is_the_default_tenants(tmp_path: Path) -> None:
    client = router(tmp_path, keys=False)
    client.get("/v1/models")
    client.post("/v1/completions", json={"prompt": "hi", "max_tokns": 2})
    assert counts(client) == {("default", "200"): 1, ("default", "400"): 1}


def test_the_operators_view_is_counted_as_the_operators(tmp_path: Path) -> None:
    client = router(tmp_path)
    status = client.get("/v1/kvpool", headers={TOKEN_HEADER: TOKEN}).status_code
    assert counts(client) == {(OPERATOR, str(status)): 1}
