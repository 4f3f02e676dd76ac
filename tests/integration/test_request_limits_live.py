"""A 10 MB request against real `kvfence serve` and `kvfence router` processes: refused with 413
in OpenAI shape before the server reads or tokenizes it, while /healthz keeps answering and the
server goes on serving."""

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvfence_engine.tools.localproc import LocalProcess

TEN_MB = 10 * 1024 * 1024
# A latency property, kept as one: before the fix /healthz stalled for the whole tokenization
# (~7 s on a quiet machine, longer on a loaded one). The bound is a hang guard: a /healthz
# answers in milliseconds, and well under this on a loaded 2-core machine.
PROBE_DEADLINE = 2.0  # seconds


@pytest.fixture(scope="module")
def router_without_backends(logs_dir: Path) -> Iterator[LocalProcess]:
    """A router whose backends are never reached: refusals happen before any backend call."""
    nowhere = "http://127.0.0.1:9"
    args = ["router", "--model", "builtin:tiny-random", "--prefill", nowhere]
    args += ["--decode", nowhere, "--context-length", "512"]
    with LocalProcess(args, log_path=logs_dir / "router-limits.log") as proc:
        yield proc


@pytest.fixture(params=["engine", "router"])
def server(
    request: pytest.FixtureRequest,
    tiny_server: LocalProcess,
    router_without_backends: LocalProcess,
) -> LocalProcess:
    return tiny_server if request.param == "engine" else router_without_backends


def ten_mb_prompt() -> bytes:
    return b'{"max_tokens": 1, "prompt": "' + b"word " * (TEN_MB // 5) + b'"}'


def chunks_of(body: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def probe_while(url: str, busy: Callable[[], bool]) -> list[float]:
    """How long each /healthz took, probing until `busy` says done (and for at least 1 s)."""
    latencies: list[float] = []
    until = time.monotonic() + 1.0
    with httpx.Client(timeout=30.0) as probe:
        while busy() or time.monotonic() < until:
            start = time.monotonic()
            assert probe.get(url + "/healthz").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    return latencies


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_ten_mb_prompt_gets_413_and_healthz_answers_meanwhile(
    server: LocalProcess, framing: str
) -> None:
    body = ten_mb_prompt()
    content: bytes | Iterator[bytes] = body if framing == "content-length" else chunks_of(body)
    answer: dict[str, httpx.Response] = {}

    def send() -> None:
        answer["r"] = httpx.post(
            server.url + "/v1/completions",
            content=content,
            headers={"content-type": "application/json"},
            timeout=60.0,
        )

    sender = threading.Thread(target=send)
    sender.start()
    latencies = probe_while(server.url, sender.is_alive)
    sender.join()
    assert max(latencies) < PROBE_DEADLINE, f"/healthz latencies: {latencies}"
    r = answer["r"]
    assert r.status_code == 413, r.text[:300]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert error["param"] is None and "4194304 bytes" in error["message"]
    # and the server goes on serving a request within the limits
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": [1] * 600}, timeout=30.0)
    assert ok.status_code == 400 and ok.json()["error"]["code"] == "context_length_exceeded"
