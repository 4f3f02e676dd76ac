"""A router app in-process, with FastAPI's TestClient, for unit tests of its HTTP surface: two
tenants, an internal token, and backends that answer nothing."""

from pathlib import Path

from fastapi.testclient import TestClient

from kvfence_engine.loading.tokenizer_source import TINY_RANDOM, load_tokenizer
from kvfence_engine.router.app import create_router_app
from kvfence_engine.router.backends import Backends
from kvfence_engine.router.keys import ApiKeys
from kvfence_engine.router.state import RouterState
from kvfence_engine.serving.limits import set_request_limits

TOKEN = "internal-" + "t" * 32
KEY_A, KEY_B = "key-a-" + "a" * 32, "key-b-" + "b" * 32
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def router(tmp_path: Path, keys: bool = True, token: str | None = TOKEN) -> TestClient:
    """A router whose backends answer nothing (port 9): a completion that passes every check
    ends in a 503 (no instance answered). `keys`: tenants tenant-a (KEY_A) and tenant-b
    (KEY_B), else none; `token`: its internal token, or none."""
    api_keys = None
    if keys:
        (tmp_path / "keys").write_text(f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
        api_keys = ApiKeys.load([str(tmp_path / "keys")])
    _, tokenizer = load_tokenizer(TINY_RANDOM)
    backends = Backends.create(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], None)
    state = RouterState("tiny", tokenizer, backends, api_keys, token, 512)
    app = create_router_app(state)
    set_request_limits(app, max_request_bytes=4096)
    return TestClient(app, raise_server_exceptions=False)
