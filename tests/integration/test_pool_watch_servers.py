"""The pool-whole invariant over a real engine process: pages a decode engine holds for a
reservation nobody completes are reported once the settle time has passed."""

from pathlib import Path

import httpx

from helpers import pool_watch
from helpers.engines import tiny_budget
from helpers.processes import serve
from helpers.transfers import reserve


def test_a_reservation_left_open_on_a_server_is_reported_as_leaked(
    logs_dir: Path, monkeypatch
) -> None:
    monkeypatch.setattr(pool_watch, "SETTLE_SECONDS", 1.0)
    before = pool_watch.snapshot()
    with serve(
        logs_dir, "pool-watch-decode", "--role", "decode", "--model", "builtin:tiny-random",
        "--kv-cache-memory", str(tiny_budget(16)), "--transfer-port", "0",
        "--reserve-timeout", "300",
    ) as decode:  # fmt: skip
        handle = reserve(decode.url, 40, seed=1)  # three pages, and no KV ever sent
        (leak,) = pool_watch.leaks(before)
        assert leak.endswith(": 13 free pages of 16, 16 at the start") and "decode" in leak
        r = httpx.post(decode.url + "/internal/abort", json={"request_id": handle.request_id})
        assert r.json() == {"aborted": True}
        assert pool_watch.leaks(before) == []
