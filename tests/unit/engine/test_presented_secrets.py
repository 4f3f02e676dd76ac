"""A secret a caller presents (an API key, the internal token) is compared as bytes in
constant time: whatever bytes it holds, a wrong one is a 401 in the OpenAI shape, never a 500
(hmac.compare_digest raises TypeError on a str with a non-ASCII character)."""

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvfence_engine.auth import secret_matches
from kvfence_engine.contracts import TOKEN_HEADER, Role
from kvfence_engine.disagg.internal_api import internal_router
from kvfence_engine.loading.tokenizer_source import TINY_RANDOM, load_tokenizer
from kvfence_engine.router.app import create_router_app
from kvfence_engine.router.backends import Backends
from kvfence_engine.router.keys import ApiKeys
from kvfence_engine.router.state import RouterState
from kvfence_engine.serving.app import create_app
from kvfence_engine.serving.state import ServerState

TOKEN = "s3cret"

# What a header can carry: latin-1 bytes (Starlette decodes headers as latin-1), UTF-8 bytes
WRONG_HEADERS = [b"s3cr\xe9t", "s3crét".encode(), b"\xff", b"s3cret\x80", b"", b"S3CRET"]


@pytest.mark.parametrize(
    ("presented", "expected", "matches"),
    [
        ("s3cret", "s3cret", True),
        (b"s3cret", "s3cret", True),
        ("s3crét", "s3crét", True),
        ("s3crét", "s3cret", False),
        ("\ud800", "s3cret", False),  # a lone surrogate, as a JSON string may carry
        ("", "", False),  # an empty secret is no secret
        (None, "s3cret", False),
        (5, "5", False),
    ],
)
def test_secrets_compare_as_bytes_whatever_they_hold(
    presented: object, expected: str, matches: bool
) -> None:
    assert secret_matches(presented, expected) is matches


@pytest.fixture
def decode_app() -> TestClient:
    """A decode engine's HTTP side with an internal token and no engine loaded: the token is
    checked before anything else."""
    state = ServerState(role=Role.DECODE, internal_token=TOKEN)
    app = create_app(state)
    app.include_router(internal_router(state))
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("header", WRONG_HEADERS)
def test_a_wrong_internal_token_of_any_bytes_is_a_401(
    decode_app: TestClient, header: bytes
) -> None:
    r = decode_app.post(
        "/internal/abort", json={"request_id": "x"}, headers={TOKEN_HEADER.encode(): header}
    )
    assert r.status_code == 401, r.text
    assert r.json() == {
        "error": {
            "message": "internal endpoint: missing or wrong internal token",
            "type": "authentication_error",
            "param": None,
            "code": "unauthorized",
        }
    }


def test_the_right_internal_token_passes_the_check(decode_app: TestClient) -> None:
    """The control: with the token, the call gets past the check (to "still loading")."""
    r = decode_app.post("/internal/abort", json={"request_id": "x"}, headers={TOKEN_HEADER: TOKEN})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


@pytest.fixture
def router(tmp_path: Path) -> TestClient:
    """A router with one tenant key and no reachable backends: /v1/models needs only the
    tenant."""
    keys = tmp_path / "api-keys"
    keys.write_text(f"{TOKEN} tenant-a\n")
    name, tokenizer = load_tokenizer(TINY_RANDOM)
    backends = Backends.create(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], None)
    state = RouterState(name, tokenizer, backends, ApiKeys.load([str(keys)]), None, 512)
    return TestClient(create_router_app(state), raise_server_exceptions=False)


@pytest.mark.parametrize("key", WRONG_HEADERS)
def test_a_wrong_api_key_of_any_bytes_is_a_401_from_the_router(
    router: TestClient, key: bytes
) -> None:
    r = router.get("/v1/models", headers={b"Authorization": b"Bearer " + key})
    assert r.status_code == 401, r.text
    assert r.json()["error"] == {
        "message": "missing or invalid API key",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }


def test_the_right_api_key_is_the_tenant(router: TestClient) -> None:
    r = router.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["data"][0]["max_model_len"] == 512
