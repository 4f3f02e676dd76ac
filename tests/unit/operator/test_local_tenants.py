"""`kvfence up`'s tenants (--tenant KEY=NAME, --api-key, --api-keys FILE), checked before
anything starts, and the record a serving `up` leaves for `kvfence canary` to find."""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfence_cli.main import build_parser
from kvfence_operator.local.state import ServingRecord, serving_at
from kvfence_operator.local.tenants import LocalTenants, TenantsError


def parsed(*flags: str) -> LocalTenants:
    args = build_parser().parse_args(["up", "x.yaml", *flags])
    return LocalTenants.make(args.api_key, args.tenants, args.api_keys)


def test_any_number_of_tenants_and_a_key_that_holds_an_equals_sign(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVFENCE_API_KEY", raising=False)
    tenants = parsed("--tenant", "sk-a-0123=team-a", "--tenant", "c2stYg===team-b")
    assert tenants.entries == (("sk-a-0123", "team-a"), ("c2stYg==", "team-b"))
    assert tenants.keys_file_lines() == "sk-a-0123 team-a\nc2stYg== team-b\n"
    assert tenants.describe() == "2 tenants: team-a, team-b"


def test_without_tenants_the_local_key_serves_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `make up` runs: one tenant, `local`, with the key the README shows."""
    from kvfence_cli.up import run

    monkeypatch.delenv("KVFENCE_API_KEY", raising=False)
    args = build_parser().parse_args(["up", "x.yaml"])
    assert args.api_key is None and args.tenants == []
    with pytest.raises(TenantsError):  # nothing at all is refused ...
        LocalTenants.make(None, [], [])
    seen: dict[str, Any] = {}
    monkeypatch.setattr("kvfence_operator.local.up.run_up", lambda a, **_: seen.update(vars(a)))
    run(args)  # ... so the command fills in the default key
    tenants = LocalTenants.make(seen["api_key"], seen["tenants"], seen["api_keys"])
    assert tenants.describe() == "api key: kvfence-local"
    both = parsed("--api-key", "mine", "--tenant", "sk-b=team-b")
    assert both.entries == (("mine", "local"), ("sk-b", "team-b"))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tenant", "sk-a=team a"], "--tenant: tenant 'team a' is not a valid tenant name"),
        (["--tenant", "sk-a=a", "--tenant", "sk-a=b"],
         "--tenant: a key of tenant 'b' is also given for tenant 'a'"),
        (["--tenant", "sk-a=kvfence-canary-a"], "tenant 'kvfence-canary-a' is the canary's own"),
    ],
)  # fmt: skip
def test_tenants_the_router_would_refuse_or_confuse_are_refused_first(
    flags: list[str], expected: str
) -> None:
    with pytest.raises(TenantsError, match="^" + re.escape(expected)) as refused:
        parsed(*flags)
    assert "sk-a" not in str(refused.value), "a key is never quoted"


def test_a_flag_without_a_name_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "up", "x.yaml", "--tenant", "sk-a-0123"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "argument --tenant: expected KEY=NAME, e.g. sk-a-0123456789=team-a" in done.stderr


def test_a_keys_file_is_read_to_check_it_and_handed_over_where_it_is(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# ours\nsk-c-0123 team-c\nsk-d-0123 team-d\n")
    tenants = parsed("--api-keys", str(keys), "--tenant", "sk-a=team-a")
    assert tenants.files == (keys.resolve(),)
    assert tenants.keys_file_lines() == "sk-a team-a\n"  # the file's keys are not copied
    assert tenants.describe() == "3 tenants: team-a, team-c, team-d"
    keys.write_text("sk-a team-z\n")
    with pytest.raises(TenantsError, match="also given for tenant 'team-a'"):
        parsed("--api-keys", str(keys), "--tenant", "sk-a=team-a")
    keys.write_text("one two three\n")
    bad = re.escape(f"--api-keys: {keys}:1: expected 'KEY TENANT'")
    with pytest.raises(TenantsError, match=bad):
        parsed("--api-keys", str(keys))
    with pytest.raises(TenantsError, match=r"--api-keys: .*No such file"):
        parsed("--api-keys", str(tmp_path / "missing"))


# --- the record of a serving `up` -----------------------------------------------------------


def record(tmp_path: Path, pid: int, url: str = "http://127.0.0.1:8123") -> ServingRecord:
    workdir = tmp_path / "up" / "tiny-0123456789"
    workdir.mkdir(parents=True, exist_ok=True)
    token = workdir / "internal-token"
    r = ServingRecord("tiny", "0123456789", pid, url, str(token), 600.0)
    r.write(workdir)
    return r


def test_the_canary_finds_the_up_that_serves_its_target(tmp_path: Path) -> None:
    mine = record(tmp_path, os.getpid())
    state = tmp_path / "up"
    for target in ("http://127.0.0.1:8123", "http://localhost:8123"):
        assert serving_at(target, state) == mine
    assert mine.workdir == state / "tiny-0123456789"
    for other in ("http://127.0.0.1:8124", "http://10.0.0.1:8123", "https://example.com"):
        assert serving_at(other, state) is None


def test_a_record_whose_up_is_gone_or_unreadable_is_not_found(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    record(tmp_path, int(gone.stdout))  # a killed `up` leaves its record behind
    assert serving_at("http://127.0.0.1:8123", tmp_path / "up") is None
    path = record(tmp_path, os.getpid()).workdir / "serving.json"
    assert ServingRecord.read(path) is not None
    whole = path.read_text()
    path.write_text(whole.replace('"name": "tiny"', '"name": 7'))
    assert ServingRecord.read(path) is None
    path.write_text('{"name": "tiny"}')  # half written
    assert serving_at("http://127.0.0.1:8123", tmp_path / "up") is None
