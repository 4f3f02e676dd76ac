"""The router's API keys: a keys file is checked line by line when it is read, and re-read
when it changes, so a revoked key stops working without a restart (issue 12, finding 6 and
"Keys")."""

import logging
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvfence_engine.contracts import ReserveBody
from kvfence_engine.loading.tokenizer_source import TINY_RANDOM, load_tokenizer
from kvfence_engine.router.app import create_router_app
from kvfence_engine.router.backends import Backends
from kvfence_engine.router.keys import (
    TENANT_MAX,
    ApiKeys,
    KeysFileError,
    parse_keys_files,
    request_id_for,
)
from kvfence_engine.router.state import RouterState

SECRET = "k-3f9a1c-never-printed"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (f"{SECRET} team/x", "tenant 'team/x' is not a valid tenant name"),
        (f"{SECRET} équipe", "tenant 'équipe' is not a valid tenant name"),
        (f"{SECRET} {'t' * (TENANT_MAX + 1)}", "is not a valid tenant name: use 1 to 95"),
        (f"{SECRET} tenant extra", "expected 'KEY TENANT', got 3 fields"),
        (SECRET, "expected 'KEY TENANT', got 1 fields"),
        ("k-é-3f9a1c tenant", "the key may hold only printable ASCII"),
        ("k-ok tenant-b", "this key is already given at"),  # line 3 repeats line 2's key
    ],
)
def test_a_bad_keys_file_is_refused_naming_its_file_and_line(
    tmp_path: Path, line: str, problem: str
) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(f"# key tenant\nk-ok tenant-a\n{line}\n")
    with pytest.raises(KeysFileError) as refused:
        ApiKeys.load([str(keys)])
    message = str(refused.value)
    assert message.startswith(f"{keys}:3: ") and problem in message, message
    assert SECRET not in message  # a key never reaches an error message or a log


def test_every_tenant_name_the_file_accepts_makes_request_ids_decode_accepts(
    tmp_path: Path,
) -> None:
    """The tenant pattern is the request-id pattern less the id's own suffix: the longest
    name of every allowed character still gives a request id ReserveBody takes."""
    alphabet = "ABCXYZabcxyz0123456789_.:-"
    longest = (alphabet * 4)[:TENANT_MAX]
    keys = tmp_path / "keys"
    keys.write_text(f"k1 {longest}\nk2 {alphabet}\nk3 a\n")
    assert parse_keys_files([str(keys)]) == {"k1": longest, "k2": alphabet, "k3": "a"}
    for tenant in (longest, alphabet, "a"):
        ReserveBody(request_id=request_id_for(tenant), prompt_ids=[1])


# --- reloading -------------------------------------------------------------------------------


class SecretMount:
    """A keys file as Kubernetes mounts a Secret: DIR/api-keys -> ..data/api-keys, and an
    update swaps the ..data symlink to a new timestamped folder in one rename."""

    def __init__(self, root: Path, text: str) -> None:
        self.root = root
        self.version = 0
        self.update(text)
        (root / "api-keys").symlink_to("..data/api-keys")
        self.path = str(root / "api-keys")

    def update(self, text: str) -> None:
        self.version += 1
        folder = self.root / f"..2026_{self.version}"
        folder.mkdir()
        (folder / "api-keys").write_text(text)
        (self.root / "..data_tmp").symlink_to(folder.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")


def router(keys: ApiKeys) -> TestClient:
    """A router app with no reachable backends: /v1/models needs only the tenant."""
    name, tokenizer = load_tokenizer(TINY_RANDOM)
    backends = Backends.create(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], None)
    return TestClient(create_router_app(RouterState(name, tokenizer, backends, keys, None, 512)))


def models(client: TestClient, key: str) -> int:
    return client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code


def test_a_revoked_key_is_refused_once_the_mounted_secret_changes(tmp_path: Path) -> None:
    mount = SecretMount(tmp_path, "key-a tenant-a\nkey-b tenant-b\n")
    keys = ApiKeys.load([mount.path])
    assert keys is not None
    client = router(keys)
    assert (models(client, "key-a"), models(client, "key-b")) == (200, 200)

    mount.update("key-b tenant-b\n")  # key-a revoked
    r = client.get("/v1/models", headers={"Authorization": "Bearer key-a"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert models(client, "key-b") == 200

    mount.update("key-b tenant-b\nkey-c tenant-c\n")  # and a new key works at once
    assert (models(client, "key-a"), models(client, "key-c")) == (401, 200)


def test_a_keys_file_rewritten_in_place_is_reread(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("key-a tenant-a\n")
    keys = ApiKeys.load([str(path)])
    assert keys is not None and keys.tenant_of("key-a") == "tenant-a"
    path.write_text("key-a2 tenant-a\n")
    assert (keys.tenant_of("key-a"), keys.tenant_of("key-a2")) == (None, "tenant-a")


def test_a_reload_that_finds_a_bad_file_keeps_the_keys_in_force_and_logs_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mount = SecretMount(tmp_path, "key-a tenant-a\n")
    keys = ApiKeys.load([mount.path])
    assert keys is not None
    mount.update("key-a tenant-a\nkey-x team/x\n")
    with caplog.at_level(logging.ERROR, logger="kvfence_engine.router.keys"):
        assert keys.tenant_of("key-a") == "tenant-a"  # still in force
        assert keys.tenant_of("key-x") is None
        keys.tenant_of("key-a")  # the same bad file is reported once, not per request
    (record,) = caplog.records
    assert "previous keys stay in force" in record.getMessage()
    assert f"{mount.path}:2: tenant 'team/x'" in record.getMessage()

    mount.update("key-x team-x\n")  # fixed: the new keys take over
    assert (keys.tenant_of("key-a"), keys.tenant_of("key-x")) == (None, "team-x")


def test_a_keys_file_that_disappears_keeps_the_keys_in_force(tmp_path: Path) -> None:
    """A Secret mount is briefly incomplete during an update; that is no revocation."""
    path = tmp_path / "keys"
    path.write_text("key-a tenant-a\n")
    keys = ApiKeys.load([str(path)])
    assert keys is not None
    path.unlink()
    assert keys.tenant_of("key-a") == "tenant-a"
