"""Aborts and crashes in the middle of a disaggregated request: nothing hangs (the engines'
reservation timeout, 3 s here, ends what nobody finishes), every page comes back, no request
continues from foreign KV."""

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.deployments import Deployment, start_deployment
from helpers.engines import prompt_of
from helpers.processes import metric
from helpers.transfers import LAYOUT, kv_pages, reserve
from helpers.waits import eventually
from kvfence_engine.disagg.transfer import Sender

# A hang guard, not a budget: pages are back (or the client has its error) within the 3 s
# reservation timeout on a quiet machine; this bounds only how long a hang takes to fail.
SETTLE_S = 60.0


def wait_for_no_pages(*urls: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if all(metric(u, "kvfence_kv_pages_used") == 0 for u in urls):
            return
        time.sleep(0.1)
    pytest.fail(
        f"pages still held after {SETTLE_S}s: {[metric(u, 'kvfence_kv_pages_used') for u in urls]}"
    )


@pytest.fixture(scope="module")
def deployment(logs_dir: Path) -> Iterator[Deployment]:
    d = start_deployment(logs_dir, "aborts", engine_args=["--reserve-timeout", "3"])
    yield d
    d.stop()


def urls(d: Deployment) -> list[str]:
    return [p.url for p in (*d.prefills, *d.decodes)]


def test_a_client_gone_during_prefill_leaves_no_pages(deployment: Deployment) -> None:
    body = json.dumps({"prompt": prompt_of(480), "max_tokens": 50}).encode()
    port = deployment.router.port
    for _ in range(3):
        # send the whole request, then hang up at once: long before any first token exists
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
    wait_for_no_pages(*urls(deployment))
    # the router kept the work until the first token existed, then cancelled decode's half
    ok = httpx.post(
        deployment.router.url + "/v1/completions", json={"prompt": "still serving", "max_tokens": 2}
    )
    assert ok.status_code == 200


def test_a_client_gone_during_decode_leaves_no_pages(deployment: Deployment) -> None:
    body = {"prompt": prompt_of(100), "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", deployment.router.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        assert metric(deployment.decodes[0].url, "kvfence_kv_pages_used") > 0
    wait_for_no_pages(*urls(deployment))


def test_a_prefill_dying_mid_transfer_leaves_no_pages_on_decode(deployment: Deployment) -> None:
    decode = deployment.decodes[0].url
    handle = reserve(decode, 40, seed=3)
    sender = Sender(handle, LAYOUT, token=None)
    sender.send_pages(0, kv_pages(1, 1.0), [16])
    sender.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sender.close()  # a reset, as when the prefill process is killed
    # nobody calls decode or abort for it (the router may be gone too): the reservation expires
    wait_for_no_pages(decode)
    r = httpx.post(
        decode + "/internal/decode",
        json={"request_id": handle.request_id, "first": {"token_id": 1}},
    )
    assert r.status_code == 404  # the half-written reservation can never be decoded


def test_a_decode_dying_mid_transfer_gives_prefill_an_error_and_no_pages(
    deployment: Deployment,
) -> None:
    fake_decode = socket.create_server(("127.0.0.1", 0))

    def die_after_some_bytes() -> None:
        conn, _ = fake_decode.accept()
        conn.recv(4096)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()

    threading.Thread(target=die_after_some_bytes, daemon=True).start()
    prompt = prompt_of(300)
    handle = {
        "request_id": "doomed",
        "seq_id": 1,
        "pages": list(range(19)),
        "tags": [1] * 19,
        "reserved_tokens": 300,
        "transfer_port": fake_decode.getsockname()[1],
    }
    r = httpx.post(
        deployment.prefills[0].url + "/internal/prefill",
        json={"handle": handle, "prompt_ids": prompt},
        timeout=SETTLE_S,  # a hang would end in ReadTimeout
    )
    assert r.status_code == 502
    assert r.json()["error"]["message"].startswith("KV transfer to decode failed")
    wait_for_no_pages(deployment.prefills[0].url)
    fake_decode.close()


def statuses_until_refused_after(router: str, kill: threading.Timer) -> list[int]:
    """Request after request, the status of each, until one sent after `kill` ran is refused
    with 503 (no backend to serve it): however slow the machine, the requests before, during
    and after the kill are all there to judge."""
    statuses: list[int] = []

    def send() -> bool:
        after = kill.finished.is_set()
        r = httpx.post(
            router + "/v1/completions",
            timeout=SETTLE_S,  # a hang would end in ReadTimeout
            json={"prompt": prompt_of(400), "max_tokens": 30},
        )
        statuses.append(r.status_code)
        return after and r.status_code == 503

    eventually(
        send, "a 503 for a request sent after the kill", SETTLE_S, describe=statuses.__repr__
    )
    return statuses


@pytest.mark.slow
def test_killing_an_engine_mid_request_ends_the_request_with_an_error_not_a_hang(
    logs_dir: Path,
) -> None:
    for victim in ("prefill", "decode"):
        d = start_deployment(logs_dir, f"kill-{victim}")
        try:
            proc = d.prefills[0] if victim == "prefill" else d.decodes[0]
            killer = threading.Timer(0.3, proc.kill)
            killer.start()
            statuses = statuses_until_refused_after(d.router.url, killer)
            killer.join()
            assert set(statuses) <= {200, 502, 503}, statuses  # an error, never a hang or 500
            survivor = d.decodes[0] if victim == "prefill" else d.prefills[0]
            wait_for_no_pages(survivor.url)
        finally:
            d.stop()
