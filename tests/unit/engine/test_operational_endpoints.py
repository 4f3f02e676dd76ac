"""Information hygiene (issue 12, finding 4): what shows pool occupancy, backend addresses or
other tenants' names and counts is for the operator, the router and Prometheus, never for a
tenant. An engine with an internal token requires it on /v1/kvpool and /metrics (in its own
header, or as a bearer token, as Prometheus sends it); the router requires it on /metrics and
shows a tenant's /v1/kvpool without addresses; a backend's server-side error reaches the client
with a generic message."""

from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from fastapi.testclient import TestClient

from helpers.router_app import KEY_A, router
from kvfence_engine.contracts import TOKEN_HEADER, ErrorCode, Role
from kvfence_engine.core import errors
from kvfence_engine.router import relay
from kvfence_engine.serving.app import create_app
from kvfence_engine.serving.state import ServerState

TOKEN = "internal-" + "t" * 32
OPERATIONAL = ["/v1/kvpool", "/v1/load", "/metrics"]


def engine(token: str | None) -> TestClient:
    """A decode engine's HTTP side, no engine loaded: /v1/kvpool says not_ready once past
    the token check, /metrics answers."""
    return TestClient(create_app(ServerState(role=Role.DECODE, internal_token=token)))


class Answer(Protocol):
    """What the check reads of a TestClient's response (httpx2's, or httpx's without it)."""

    @property
    def status_code(self) -> int: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


def passed_the_check(path: str, r: Answer) -> bool:
    if path == "/metrics":
        return r.status_code == 200 and "kvfence_" in r.text
    return r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


@pytest.mark.parametrize("path", OPERATIONAL)
@pytest.mark.parametrize(
    "headers",
    [{}, {TOKEN_HEADER: "wrong"}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}],
    ids=["none", "wrong-header", "wrong-bearer", "no-bearer-prefix"],
)
def test_an_engine_with_a_token_refuses_its_pool_and_metrics_without_it(
    path: str, headers: dict[str, str]
) -> None:
    r = engine(TOKEN).get(path, headers=headers)
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "unauthorized"
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", OPERATIONAL)
@pytest.mark.parametrize(
    "headers",
    [{TOKEN_HEADER: TOKEN}, {"Authorization": f"Bearer {TOKEN}"}],
    ids=["header", "bearer"],
)
def test_an_engine_with_a_token_answers_with_it_in_the_header_or_as_a_bearer(
    path: str, headers: dict[str, str]
) -> None:
    assert passed_the_check(path, engine(TOKEN).get(path, headers=headers))


@pytest.mark.parametrize("path", OPERATIONAL)
def test_an_engine_without_a_token_file_keeps_them_open(path: str) -> None:
    """The negative control: a lone combined engine on a laptop has no token to ask for."""
    assert passed_the_check(path, engine(None).get(path))


def test_health_and_readiness_stay_open_and_say_only_the_status() -> None:
    client = engine(TOKEN)
    assert client.get("/healthz").status_code == 200
    r = client.get("/readyz")
    assert r.status_code == 503
    assert r.json() == {"status": "loading", "error": None, "progress": None}


def test_a_tenant_cannot_read_the_routers_metrics(tmp_path: Path) -> None:
    client = router(tmp_path, token=TOKEN)
    r = client.get("/metrics", headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["type"] == "permission_error"
    assert "tenant-a" not in r.text
    r = client.get("/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


@pytest.mark.parametrize(
    "headers",
    [{TOKEN_HEADER: TOKEN}, {"Authorization": f"Bearer {TOKEN}"}],
    ids=["header", "bearer"],
)
def test_the_routers_metrics_answer_the_internal_token(
    tmp_path: Path, headers: dict[str, str]
) -> None:
    r = router(tmp_path, token=TOKEN).get("/metrics", headers=headers)
    assert r.status_code == 200 and "# TYPE kvfence_router_requests_total counter" in r.text


def test_a_router_with_keys_and_no_token_shows_its_metrics_to_nobody(tmp_path: Path) -> None:
    client = router(tmp_path, token=None)
    for headers in ({}, {"Authorization": f"Bearer {KEY_A}"}):
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 403 and "--internal-token-file" in r.json()["error"]["message"]


def test_a_router_with_neither_keys_nor_token_keeps_its_metrics_open(tmp_path: Path) -> None:
    """The negative control: one user on a laptop, no tenants to keep apart."""
    assert router(tmp_path, keys=False, token=None).get("/metrics").status_code == 200


def test_a_backends_server_error_reaches_the_client_without_its_detail() -> None:
    full = errors.overloaded("no free KV pages for 300 tokens: need 19 pages, 3 free", 1)
    shown = relay.client_facing(full, "tenant-a-0123")
    assert (shown.status, shown.type, shown.code, shown.retry_after) == (
        503,
        "server_error",
        "overloaded",
        1,
    )
    assert "free" not in shown.message and "300" not in shown.message
    assert "tenant-a-0123" in shown.message  # what to quote to the operator
    gone = errors.transfer_failed("KV transfer to decode failed: 10.0.3.7:9000")
    assert "10.0.3.7" not in relay.client_facing(gone, "r").message


def test_a_backends_error_body_reads_back_as_sent_and_a_foreign_code_is_a_bad_gateway() -> None:
    """What an engine wrote comes back as the same error, its code an ErrorCode member; an
    error body with a code kvfence never writes (another program on that address) is not
    passed on as one of ours."""
    sent = errors.tenant_pool_share("tenant a already reserves its share")
    read = relay.error_from(httpx.Response(429, json=sent.body(), headers={"Retry-After": "1"}))
    assert (read.status, read.type, read.message, read.retry_after) == (
        429,
        "tokens",
        sent.message,
        1,
    )
    assert read.code is ErrorCode.TENANT_POOL_SHARE
    foreign = {"error": {"message": "no", "type": "invalid_request_error", "code": "nope"}}
    refused = relay.error_from(httpx.Response(400, json=foreign))
    assert (refused.status, refused.code) == (502, ErrorCode.BAD_GATEWAY)


def test_a_backends_client_error_passes_on_whole() -> None:
    """The control: a 4xx is about the request, and the client needs its detail."""
    too_long = errors.context_length_exceeded(600, 512, "the served context")
    assert relay.client_facing(too_long, "r") is too_long
    internal = errors.internal_error("abc123")  # names a reference, nothing internal
    assert relay.client_facing(internal, "r") is internal
