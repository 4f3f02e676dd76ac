"""Bounded work before authentication and tokenization (issue 12, finding 3): a body over the
cap is refused before it is read, a prompt too long for the context is refused before it is
tokenized, and tokenizing runs off the event loop, on the engine and the router alike."""

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from starlette.types import Message, Receive, Scope, Send
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from helpers.engines import make_tiny_engine
from kvfence_cli.main import build_parser
from kvfence_engine.loading.tokenizer import Tokenizer, max_chars_per_token
from kvfence_engine.loading.tokenizer_source import TINY_RANDOM, load_tokenizer
from kvfence_engine.router.app import create_router_app
from kvfence_engine.router.backends import Backends
from kvfence_engine.router.state import RouterState
from kvfence_engine.serving.app import create_app
from kvfence_engine.serving.async_engine import AsyncEngine
from kvfence_engine.serving.connections import HEADER_SECONDS
from kvfence_engine.serving.limits import (
    COALESCE_BYTES,
    DEFAULT_BODY_SECONDS,
    DEFAULT_MAX_REQUEST_BYTES,
    BodyLimit,
    RequestLimits,
    set_request_limits,
)
from kvfence_engine.serving.state import ServerState

CONTEXT = 512
NOWHERE = "http://127.0.0.1:9"  # the router's backends: nothing here is ever reached
_, TOKENIZER = load_tokenizer(TINY_RANDOM)  # SmolLM2's byte-level BPE
LONGEST = max(TOKENIZER.backend.get_vocab(), key=len)  # "\n" and 80 spaces, one token


def token_text(token: str) -> str:
    """What the tokenizer decodes one vocabulary token to."""
    token_id = TOKENIZER.backend.token_to_id(token)
    assert token_id is not None, token
    return TOKENIZER.backend.decode([token_id])


LONGEST_TEXT = token_text(LONGEST)


# --- the body cap, as an ASGI middleware -----------------------------------------------------


def http_scope(headers: dict[str, str]) -> Scope:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }


class Recorder:
    """An app that reads its whole body and answers 200; remembers what it read."""

    def __init__(self) -> None:
        self.chunks: list[bytes] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.chunks = []
        while True:
            message = await receive()
            self.chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def run_asgi(app: Any, scope: Scope, receive: Receive) -> tuple[int, bytes]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def chunks(*bodies: bytes, endless: bytes | None = None) -> tuple[Receive, list[int]]:
    """A receive() that hands out `bodies` (then `endless` forever) and counts its calls."""
    calls = [0]

    async def receive() -> Message:
        calls[0] += 1
        if calls[0] <= len(bodies):
            more = calls[0] < len(bodies) or endless is not None
            return {"type": "http.request", "body": bodies[calls[0] - 1], "more_body": more}
        assert endless is not None, "read past the end of the body"
        return {"type": "http.request", "body": endless, "more_body": True}

    return receive, calls


def assert_request_too_large(status: int, body: bytes, limit: int) -> None:
    assert status == 413
    error = json.loads(body)["error"]
    assert error == {
        "message": error["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert f"at most {limit} bytes" in error["message"]


def test_a_declared_body_over_the_cap_gets_413_before_one_byte_is_read() -> None:
    app = Recorder()
    receive, calls = chunks(endless=b"x" * 64)
    status, body = run_asgi(
        BodyLimit(app, RequestLimits(100)), http_scope({"content-length": "101"}), receive
    )
    assert_request_too_large(status, body, 100)
    assert calls[0] == 0 and app.chunks is None


def test_a_chunked_body_is_read_only_until_it_passes_the_cap() -> None:
    app = Recorder()
    receive, calls = chunks(endless=b"x" * 64)  # a client that never stops sending
    status, body = run_asgi(BodyLimit(app, RequestLimits(100)), http_scope({}), receive)
    assert_request_too_large(status, body, 100)
    assert calls[0] == 2 and app.chunks == []  # 128 bytes read of an endless body, none handed on


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_of_exactly_the_cap_reaches_the_app_intact(framing: str) -> None:
    """The negative control: at the cap nothing is refused, and the app reads the whole body,
    its chunks joined."""
    app = Recorder()
    parts = (b"a" * 40, b"b" * 40, b"c" * 20)
    headers = {"content-length": "100"} if framing == "content-length" else {}
    receive, _ = chunks(*parts)
    status, body = run_asgi(BodyLimit(app, RequestLimits(100)), http_scope(headers), receive)
    assert (status, body) == (200, b"ok")
    assert app.chunks == [b"".join(parts)]


class Refuser:
    """An app that answers 401 on the headers, as a route with a key check does."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_the_app_does_not_ask_for_is_never_read(framing: str) -> None:
    """Issue 33, finding 3: before, a chunked body was read whole before the app (and its key
    check) ran, kept message by message."""
    headers = {"content-length": "100"} if framing == "content-length" else {}
    receive, calls = chunks(endless=b"x")
    status, _ = run_asgi(BodyLimit(Refuser(), RequestLimits(100)), http_scope(headers), receive)
    assert status == 401 and calls[0] == 0


def test_a_body_sent_a_byte_at_a_time_reaches_the_app_in_joined_pieces() -> None:
    """Memory a byte a byte: 200,000 one-byte chunks reach the app as four pieces, not as
    200,000 messages (33 bytes of router memory per byte sent, before)."""
    app = Recorder()
    receive, calls = chunks(*([b"x"] * 200_000))
    status, _ = run_asgi(BodyLimit(app, RequestLimits(1 << 20)), http_scope({}), receive)
    assert status == 200 and calls[0] == 200_000
    assert app.chunks is not None and b"".join(app.chunks) == b"x" * 200_000
    assert [len(c) for c in app.chunks] == [COALESCE_BYTES] * 3 + [200_000 - 3 * COALESCE_BYTES]


def test_a_body_that_does_not_arrive_in_time_gets_408() -> None:
    sent = [0]

    async def trickle() -> Message:
        """A byte every 50 ms; after 600 of them (30 s: a hang guard) the body ends, and a
        limit that never fired answers 200."""
        await asyncio.sleep(0.05)
        sent[0] += 1
        return {"type": "http.request", "body": b"x", "more_body": sent[0] < 600}

    app = Recorder()
    start = time.monotonic()
    status, body = run_asgi(BodyLimit(app, RequestLimits(1 << 20, 0.5)), http_scope({}), trickle)
    assert status == 408 and time.monotonic() - start >= 0.5  # at the deadline, not before
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"


def test_a_content_length_that_is_not_a_number_gets_400() -> None:
    receive, calls = chunks(b"{}")
    status, body = run_asgi(
        BodyLimit(Recorder(), RequestLimits(100)), http_scope({"content-length": "-1"}), receive
    )
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_request"
    assert calls[0] == 0


# --- the body cap on the engine's and the router's apps ----------------------------------------


def router_state() -> RouterState:
    backends = Backends.create([NOWHERE], [NOWHERE], None)
    return RouterState("tiny-random", TOKENIZER, backends, None, None, CONTEXT)


@pytest.fixture(scope="module")
def engine_state() -> Iterator[ServerState]:
    """A combined engine in-process: tiny-random, context 512."""
    engine = AsyncEngine(make_tiny_engine(pages=64, context_length=CONTEXT))
    engine.start()
    yield ServerState(engine=engine)
    engine.stop()


@pytest.fixture(params=["engine", "router"])
def served(request: pytest.FixtureRequest) -> tuple[FastAPI, CollectorRegistry]:
    """The engine's or the router's app, and its metrics."""
    if request.param == "router":
        state = router_state()
        return create_router_app(state), state.metrics.registry
    engine_state = request.getfixturevalue("engine_state")
    return create_app(engine_state), engine_state.metrics.registry


@pytest.fixture
def app(served: tuple[FastAPI, CollectorRegistry]) -> FastAPI:
    return served[0]


def over(limit: int) -> bytes:
    return b'{"prompt": "' + b"x" * limit + b'"}'


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_over_cap_body_gets_413_in_openai_shape_and_the_server_keeps_serving(
    app: FastAPI, framing: str
) -> None:
    set_request_limits(app, 2000)
    body = over(2000)
    content: bytes | Iterator[bytes] = body if framing == "content-length" else iter([body])
    with TestClient(app) as c:
        r = c.post("/v1/completions", content=content, headers={"content-type": "x"})
        assert_request_too_large(r.status_code, r.content, 2000)
        assert c.get("/healthz").status_code == 200
        r = c.post("/v1/completions", json={"prompt": [1] * (CONTEXT + 1)})
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_the_default_cap_admits_a_body_just_under_it(app: FastAPI) -> None:
    body = b'{"max_tokens": 1, "prompt": "' + b"x" * (DEFAULT_MAX_REQUEST_BYTES - 40) + b'"}'
    assert len(body) < DEFAULT_MAX_REQUEST_BYTES
    with TestClient(app) as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.json()["error"]["code"] == "context_length_exceeded"  # read, then refused as long


@pytest.mark.parametrize("command", ["serve", "router"])
def test_max_request_bytes_is_a_flag_of_serve_and_router(command: str) -> None:
    parser = build_parser()
    base = ["serve", "--model", "m"] if command == "serve" else ["router"]
    assert parser.parse_args(base).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert parser.parse_args([*base, "--max-request-bytes", "1Mi"]).max_request_bytes == 1 << 20
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--max-request-bytes", "0"])
    args = parser.parse_args(base)
    assert args.client_header_timeout == HEADER_SECONDS
    assert args.client_body_timeout == DEFAULT_BODY_SECONDS
    timeouts = ["--client-header-timeout", "2.5", "--client-body-timeout", "7"]
    args = parser.parse_args([*base, *timeouts])
    assert (args.client_header_timeout, args.client_body_timeout) == (2.5, 7.0)


# --- the character cap --------------------------------------------------------------------------


def test_no_smollm2_token_stands_for_more_than_81_characters() -> None:
    assert TOKENIZER.chars_per_token == len(LONGEST) == len(LONGEST_TEXT) == 81
    assert len(TOKENIZER.encode(LONGEST_TEXT * 100)) == 100


def bpe(**kwargs: Any) -> HFTokenizer:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4}
    return HFTokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], **kwargs))


def test_the_character_bound_is_derived_only_where_no_character_is_dropped_or_merged() -> None:
    byte_fallback = bpe(byte_fallback=True, unk_token="<unk>")
    byte_fallback.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]  # Llama 2's, grows only
    )
    assert max_chars_per_token(byte_fallback) == len("<unk>")
    byte_level = bpe()
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_chars_per_token(byte_level) == len("<unk>")
    unknown_runs = bpe(unk_token="<unk>", fuse_unk=True)  # a run of unknowns is one token
    assert max_chars_per_token(unknown_runs) is None
    drops_spaces = bpe(byte_fallback=True)
    drops_spaces.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_chars_per_token(drops_spaces) is None
    composes = bpe(byte_fallback=True)
    composes.normalizer = normalizers.NFC()  # e + U+0301 becomes one character
    assert max_chars_per_token(composes) is None
    collapses = bpe(byte_fallback=True)
    collapses.normalizer = normalizers.Replace("  ", " ")
    assert max_chars_per_token(collapses) is None


@pytest.fixture
def tokenized(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What Tokenizer.encode and encode_prompt were asked to tokenize (they still tokenize)."""
    texts: list[str] = []
    for name in ("encode", "encode_prompt"):
        encode = getattr(Tokenizer, name)

        def recording(self: Tokenizer, text: str, encode: Any = encode) -> list[int]:
            texts.append(text)
            return encode(self, text)

        monkeypatch.setattr(Tokenizer, name, recording)
    return texts


def rejected_for_length(registry: CollectorRegistry) -> float:
    labels = {"reason": "context_length_exceeded"}
    return registry.get_sample_value("kvfence_requests_rejected_total", labels) or 0.0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": LONGEST_TEXT * CONTEXT + "x"}, "prompt"),
        ("/v1/completions", {"prompt": [LONGEST_TEXT * CONTEXT + "x"]}, "prompt"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": LONGEST_TEXT * (CONTEXT // 2)},
                    {"role": "user", "content": [{"type": "text", "text": "x" * 41000}]},
                ]
            },
            "messages",
        ),
    ],
)
def test_a_prompt_with_more_characters_than_the_context_can_hold_is_refused_untokenized(
    served: tuple[FastAPI, CollectorRegistry],
    tokenized: list[str],
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    app, registry = served
    before = rejected_for_length(registry)
    with TestClient(app) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "context_length_exceeded",
        param,
        "invalid_request_error",
    )
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert "at most 81 characters each" in error["message"]
    assert tokenized == []
    assert rejected_for_length(registry) == before + 1  # counted as admission's refusals are


def test_a_prompt_of_exactly_the_character_cap_is_tokenized_and_served(
    engine_state: ServerState, tokenized: list[str]
) -> None:
    """The negative control: the bound is tight, not a guess. The context's worth of the longest
    token is exactly the context in tokens, and it is served."""
    prompt = LONGEST_TEXT * CONTEXT
    with TestClient(create_app(engine_state)) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == CONTEXT
    assert tokenized == [prompt]


def test_the_router_tokenizes_a_prompt_of_exactly_the_character_cap(tokenized: list[str]) -> None:
    prompt = LONGEST_TEXT * CONTEXT
    with TestClient(create_router_app(router_state())) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 503, r.text  # admitted, then no backend to go to
    assert tokenized == [prompt]


# --- tokenizing off the event loop ----------------------------------------------------------------


@pytest.fixture
def slow_tokenizer(monkeypatch: pytest.MonkeyPatch) -> dict[str, threading.Event]:
    """Tokenize as slowly as a huge prompt would, without holding the GIL: until the test
    sets "release" (after its probe), 30 s at most (a hang guard)."""
    events = {e: threading.Event() for e in ("started", "release", "finished")}
    for name in ("encode", "encode_prompt"):  # a chat's, a completion's
        encode = getattr(Tokenizer, name)

        def slow(self: Tokenizer, text: str, encode: Any = encode) -> list[int]:
            events["started"].set()
            events["release"].wait(30)
            events["finished"].set()
            return encode(self, text)

        monkeypatch.setattr(Tokenizer, name, slow)
    return events


async def request_and_probe(
    app: FastAPI, path: str, body: dict[str, Any], events: dict[str, threading.Event]
) -> tuple[float, bool]:
    """Send `body`; once its tokenization has started, time a /readyz and say whether it came
    back while the tokenization was still going on (it is held until then)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvfence") as client:
        work = asyncio.ensure_future(client.post(path, json=body, timeout=30.0))
        deadline = time.monotonic() + 30.0  # a hang guard
        while not events["started"].is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        start = time.monotonic()
        probe = await client.get("/readyz")
        latency, during = time.monotonic() - start, not events["finished"].is_set()
        events["release"].set()
        assert probe.status_code == 200
        await work
    return latency, during


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hello " * 1000, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        ),
    ],
)
def test_readyz_answers_while_a_prompt_is_being_tokenized(
    app: FastAPI, slow_tokenizer: dict[str, threading.Event], path: str, body: dict[str, Any]
) -> None:
    """The fact, not a latency: the tokenization is held until /readyz has answered, so an
    event loop that waited for it answers only after the 30 s guard, and `during` is False."""
    latency, during = asyncio.run(request_and_probe(app, path, body, slow_tokenizer))
    assert during, f"/readyz waited for the tokenization to finish ({latency:.1f} s)"


def test_tokenizing_a_long_prompt_lets_other_threads_run() -> None:
    """Tokenizer.encode releases the GIL: a worker thread tokenizing does not stop the loop."""
    text = "hello world, this is a test. " * 40_000  # over a million characters
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.monotonic()
    TOKENIZER.encode(text)
    took = time.monotonic() - start
    done.set()
    ticker.join()
    during = [t for t in ticks if start < t < start + took]
    assert took > 0.1 and len(during) >= 10, (took, len(during))
