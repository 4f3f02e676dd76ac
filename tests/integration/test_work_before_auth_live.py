"""No work before authentication, and no connection held for long (issue 33, findings 2 and 3),
against real `kvfence router` and `kvfence serve --role prefill` processes over real sockets.

Before the fix, with no API key: a body of ~200k invalid chat messages cost the router 7.7 s of
CPU, stalled /healthz 14 s, peaked at 730 MB and was answered with a 29 MB error; a chunked
body sent a byte a chunk was kept at 33 bytes of memory per byte; a connection with partial
headers stayed open for as long as the client liked. With a key, 140k empty messages passed
the character cap and were tokenized for a 512-token context.
"""

import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from helpers.processes import serve
from kvfence_engine.serving.limits import DEFAULT_MAX_REQUEST_BYTES
from kvfence_engine.serving.protocol import MAX_ITEMS
from kvfence_engine.tools.localproc import LocalProcess

KEY = "a-real-key"
TOKEN = "the-internal-token"
HEADER_TIMEOUT = 1.0  # seconds: --client-header-timeout
BODY_TIMEOUT = 2.0  # seconds: --client-body-timeout
# For /healthz while the attack runs: a latency property kept as one, its bound a hang guard
# (a /healthz answers in milliseconds, and well under this on a loaded 2-core machine).
PROBE_DEADLINE = 2.0  # seconds
# How long a connection may stay open before the server is said never to close it: a hang
# guard, 20 times the header deadline (the server closes at the deadline; a server without one
# would keep a trickled request open for a minute or more, until a size limit).
CLOSE_GUARD = 20 * HEADER_TIMEOUT
RSS_ALLOWANCE = 100 * 1024 * 1024  # bytes over idle


@pytest.fixture(scope="module")
def router(logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalProcess]:
    """A router with API keys whose backends are never reached: everything here is refused
    before any backend call."""
    keys = tmp_path_factory.mktemp("auth-first") / "keys"
    keys.write_text(f"{KEY} tenant-a\n")
    nowhere = "http://127.0.0.1:9"
    args = ["router", "--model", "builtin:tiny-random", "--prefill", nowhere, "--decode", nowhere]
    args += ["--context-length", "512", "--api-keys", str(keys)]
    args += ["--client-header-timeout", str(HEADER_TIMEOUT)]
    args += ["--client-body-timeout", str(BODY_TIMEOUT)]
    with LocalProcess(args, log_path=logs_dir / "router-auth-first.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def prefill(logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalProcess]:
    token = tmp_path_factory.mktemp("auth-first-prefill") / "token"
    token.write_text(TOKEN + "\n")
    args = ["--role", "prefill", "--model", "builtin:tiny-random", "--context-length", "512"]
    args += ["--internal-token-file", str(token), "--transfer-port", "0"]
    with serve(logs_dir, "prefill-auth-first", *args) as proc:
        yield proc


def invalid_messages_body() -> bytes:
    """Just under the body cap: ~200k chat messages, each invalid (no such role)."""
    message = b'{"role":"x","content":""},'
    count = (DEFAULT_MAX_REQUEST_BYTES - 64) // len(message)
    return b'{"messages":[' + message * (count - 1) + message[:-1] + b"]}"


def rss(proc: LocalProcess) -> int:
    assert proc.proc is not None
    with open(f"/proc/{proc.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {proc.proc.pid}")


def while_probing(proc: LocalProcess, attack: Callable[[], None]) -> tuple[list[float], int]:
    """Run `attack` while probing /healthz and sampling the process's memory: the probes'
    latencies (for at least 1 s) and the highest RSS seen."""
    done = threading.Event()
    peak = [rss(proc)]

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss(proc))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()

    def attack_then_stop() -> None:
        try:
            attack()
        finally:
            done.set()

    attacker = threading.Thread(target=attack_then_stop)
    attacker.start()
    latencies: list[float] = []
    until = time.monotonic() + 1.0
    with httpx.Client(timeout=30.0) as probe:
        while attacker.is_alive() or time.monotonic() < until:
            start = time.monotonic()
            assert probe.get(proc.url + "/healthz").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    attacker.join()
    done.set()
    sampler.join()
    return latencies, peak[0]


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(url, content=body, headers=headers, timeout=60.0)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_four_unauthenticated_bodies_at_the_cap_cost_the_router_nothing(
    router: LocalProcess, route: str
) -> None:
    body = invalid_messages_body()
    assert len(body) < DEFAULT_MAX_REQUEST_BYTES
    idle = rss(router)
    answers: list[httpx.Response] = []

    def attack() -> None:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers.extend(pool.map(lambda _: post(router.url + route, body), range(4)))

    latencies, peak = while_probing(router, attack)
    assert max(latencies) < PROBE_DEADLINE, f"/healthz latencies: {latencies}"
    assert peak - idle < RSS_ALLOWANCE, f"RSS {idle} idle, {peak} at peak"
    for r in answers:
        assert r.status_code == 401, r.text[:300]
        assert r.json()["error"]["code"] == "invalid_api_key" and len(r.content) < 300


def test_an_internal_endpoint_checks_its_token_before_the_body(prefill: LocalProcess) -> None:
    """The status is the fact: read first, this body (no handle, no prompt_ids) is a 400."""
    r = post(prefill.url + "/internal/prefill", invalid_messages_body())
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text[:300]
    assert len(r.content) < 300
    # the negative control: with the token the same body is read, and refused as invalid
    r = post(prefill.url + "/internal/prefill", b"{}", {"X-Kvfence-Internal-Token": TOKEN})
    assert r.status_code == 400, r.text[:300]


def test_messages_past_the_bound_are_one_short_error(router: LocalProcess) -> None:
    """With a key: 140k empty messages (they passed the character cap, which counts content)
    are refused at the first one past MAX_ITEMS, in one short answer."""
    empty = b'{"role":"user","content":""},'
    body = b'{"messages":[' + empty * 140_000 + b'{"role":"user"}]}'
    r = post(router.url + "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and len(r.content) < 500, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == "messages" and f"at most {MAX_ITEMS} items" in error["message"]


def test_more_messages_than_the_context_has_tokens_are_refused_untokenized(
    router: LocalProcess,
) -> None:
    body = {"messages": [{"role": "user", "content": ""}] * 513}
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30.0,
    )
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "513 messages" in error["message"]


def raw_connection(router: LocalProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", router.port), timeout=10.0)
    sock.settimeout(10.0)
    return sock


def until_closed(sock: socket.socket, trickle: bytes = b"") -> tuple[float, bytes]:
    """Send `trickle` every 50 ms until the server closes the connection (a reset counts):
    how long that took, and what the server answered. Fails if it stays open CLOSE_GUARD."""
    start = time.monotonic()
    answer = b""
    sock.setblocking(False)
    while True:
        if time.monotonic() - start > CLOSE_GUARD:
            pytest.fail(f"the server kept the connection open {CLOSE_GUARD:g}s: {answer[:200]!r}")
        try:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        except BlockingIOError:
            pass
        except ConnectionResetError:
            break
        try:
            if trickle:
                sock.send(trickle)
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.05)
    return time.monotonic() - start, answer


def first_body(answer: bytes) -> bytes:
    """The body of the first response in `answer` (by its Content-Length)."""
    head, _, rest = answer.partition(b"\r\n\r\n")
    lengths = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return rest[: int(lengths[0].split(b":")[1])]


def test_a_connection_with_partial_headers_is_closed_at_the_header_deadline(
    router: LocalProcess,
) -> None:
    with raw_connection(router) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvfence\r\n")
        _, answer = until_closed(sock, b"X-Slow: 1\r\n")
    assert answer == b""


def test_an_unauthenticated_body_sent_a_byte_a_chunk_is_answered_and_cut_off(
    router: LocalProcess,
) -> None:
    idle = rss(router)
    with raw_connection(router) as sock:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvfence\r\n"
        sock.sendall(head + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        _, answer = until_closed(sock, b"1\r\n[\r\n" * 200)
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert rss(router) - idle < 10 * 1024 * 1024


def test_an_authenticated_body_that_does_not_arrive_in_time_gets_408(router: LocalProcess) -> None:
    with raw_connection(router) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: kvfence\r\n"
        auth = f"Authorization: Bearer {KEY}\r\n".encode()
        sock.sendall(head + auth + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        took, answer = until_closed(sock, b"{")
    # a 408, not the 400 of a body completed a byte at a time (100 bytes: 5 s of trickle)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert json.loads(first_body(answer))["error"]["code"] == "request_timeout"
    assert took >= BODY_TIMEOUT  # not cut off before its deadline
