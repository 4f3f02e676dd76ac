"""The transfer port against a hostile or broken client: every frame field is checked before
anything is written, a transfer that went wrong in any way still ends (so its pages come
back), a connection must say HELLO within a deadline, and only so many connections are served
at once. Whatever is wrong, the client gets a reply saying so, never a silent close.

In-process: a decode engine's reservations with their receiver on a real TCP port, and a raw
client that writes the frames itself (the wire format of kvfence_engine/disagg/transfer.py)."""

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from helpers.engines import make_tiny_engine, prompt_of
from helpers.pool_watch import watch_reservations
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import Request, SamplingParams, TokenLogprob
from kvfence_engine.disagg.receiver import KVReceiver
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.disagg.transfer import (
    Handle,
    Layout,
    Sender,
    TransferError,
    checksum,
    page_views,
    read_frame_header,
    recv_json,
    send_kv,
)

PAGE = 16
PROMPT = prompt_of(40)  # three pages: 16 + 16 + 8 tokens
TOKEN = "s3cret"
REPLY_WAIT = 30.0  # how long the client waits for a reply before calling it a hang (a guard)

ReceiverFactory = Callable[..., tuple[DecodeReservations, KVReceiver]]


@pytest.fixture
def decode() -> Iterator[ReceiverFactory]:
    """Start a decode engine's reservations and receiver with the given receiver settings."""
    started: list[KVReceiver] = []

    def start(**settings: object) -> tuple[DecodeReservations, KVReceiver]:
        book = watch_reservations(DecodeReservations(make_tiny_engine(pages=16, role="decode")))
        receiver = KVReceiver(book, "127.0.0.1", 0, **({"token": None} | settings))  # type: ignore[arg-type]
        book.engine.args.transfer_port = receiver.port
        receiver.start()
        started.append(receiver)
        return book, receiver

    yield start
    for receiver in started:
        receiver.stop()


def reserve(book: DecodeReservations, request_id: str = "r") -> tuple[Request, Handle]:
    seq = book.engine.admit(PROMPT, SamplingParams(max_tokens=1), max_tokens=4)
    return seq, book.reserve(seq, request_id)


def connect(receiver: KVReceiver) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=REPLY_WAIT)
    return sock


def send_hello(sock: socket.socket, handle: Handle, layout: Layout, **changes: object) -> None:
    hello = {
        "request_id": handle.request_id,
        "seq_id": handle.seq_id,
        "pages": handle.pages,
        "tags": handle.tags,
        "token": None,
        "layout": {
            "layers": layout.layers,
            "page_size": layout.page_size,
            "kv_heads": layout.kv_heads,
            "head_dim": layout.head_dim,
            "dtype": layout.dtype,
        },
        "checksum": True,
    } | changes
    send_json_frame(sock, json.dumps(hello).encode())


def send_json_frame(sock: socket.socket, body: bytes, magic: bytes = b"KVFH") -> None:
    sock.sendall(magic + struct.pack("<I", len(body)) + body)


def page_payload(layout: Layout, value: float = 1.0) -> bytes:
    shape = (1, layout.layers, layout.page_size, layout.kv_heads, layout.head_dim)
    ((k, v),) = page_views(torch.full(shape, value), torch.full(shape, value))
    return bytes(k) + bytes(v)


def send_page(
    sock: socket.socket,
    index: int,
    page: int,
    tag: int,
    tokens: int,
    payload: bytes,
    nbytes: int | None = None,
) -> None:
    """A PAGE frame as the wire format defines it: b"KVFP" u32 index, u32 page, u64 tag,
    u32 tokens, u64 xxh3, u64 nbytes, then the payload."""
    size = len(payload) if nbytes is None else nbytes
    header = struct.pack("<4sIIQIQQ", b"KVFP", index, page, tag, tokens, checksum(payload), size)
    with contextlib.suppress(OSError):  # it may refuse the header and close before the payload
        sock.sendall(header + payload)


def reply_bytes(ok: bool, code: str, message: str) -> bytes:
    body = json.dumps({"ok": ok, "code": code, "message": message}).encode()
    return struct.pack("<I", len(body)) + body


def send_end(sock: socket.socket, tokens: int) -> None:
    with contextlib.suppress(OSError):
        send_json_frame(sock, json.dumps({"tokens_written": tokens}).encode(), b"KVFE")


def reply_of(sock: socket.socket) -> dict[str, object]:
    """The receiver's verdict; fails the test if the connection closes without one."""
    try:
        return recv_json(sock)
    finally:
        sock.close()


def wait_until_ended(seq: Request) -> None:
    """The client may read the verdict just before the receiver thread returns."""
    assert seq.inbound is not None
    deadline = time.monotonic() + REPLY_WAIT
    while not seq.inbound.done:
        assert time.monotonic() < deadline, "the receiver never ended the transfer"
        time.sleep(0.01)


def assert_refused_and_pages_back(
    book: DecodeReservations, seq: Request, code: str, others_hold: int = 0
) -> None:
    """The transfer ended with `code`; decoding from it is refused and its pages are back
    (`others_hold`: pages other reservations hold meanwhile)."""
    wait_until_ended(seq)
    assert seq.inbound is not None and seq.inbound.error is not None
    assert seq.inbound.error.code == code
    with pytest.raises(EngineError) as refused:
        book.start_decode("r", TokenLogprob(1, 0.0))
    assert refused.value.code == code
    assert book.engine.pages.num_used == others_hold


# --- page frames -----------------------------------------------------------------------------


def bad_frames(handle: Handle, other: Handle) -> dict[str, tuple[int, int, int, int]]:
    """(index, page, tag, tokens) of frames that break one rule each."""
    pages, tags = handle.pages, handle.tags
    return {
        "page index past the pool": (0, 10_000, tags[0], PAGE),
        "frame index past the reservation": (7, pages[0], tags[0], PAGE),
        "page that is not the index's": (0, pages[1], tags[1], PAGE),
        "another reservation's page": (0, other.pages[0], other.tags[0], PAGE),
        "tag that is not the reservation's": (0, pages[0], tags[0] + 1, PAGE),
        "no tokens": (0, pages[0], tags[0], 0),
        "more tokens than a page": (0, pages[0], tags[0], PAGE + 1),
        "more tokens than the last page holds": (2, pages[2], tags[2], PAGE),
    }


@pytest.mark.parametrize(
    "rule",
    [
        "page index past the pool",
        "frame index past the reservation",
        "page that is not the index's",
        "another reservation's page",
        "tag that is not the reservation's",
        "no tokens",
        "more tokens than a page",
        "more tokens than the last page holds",
    ],
)
def test_a_page_frame_outside_the_reservation_is_refused_before_any_write_and_the_pages_come_back(
    decode: ReceiverFactory, rule: str
) -> None:
    book, receiver = decode()
    seq, handle = reserve(book, "r")
    other_seq, other = reserve(book, "other")
    layout = receiver.layout
    sock = connect(receiver)
    send_hello(sock, handle, layout)
    index, page, tag, tokens = bad_frames(handle, other)[rule]
    send_page(sock, index, page, tag, tokens, page_payload(layout))
    send_end(sock, len(PROMPT))
    reply = reply_of(sock)
    assert reply["ok"] is False and reply["code"] == "bad_frame", reply
    assert_refused_and_pages_back(book, seq, "bad_frame", others_hold=len(other.pages))
    # nothing reached the other reservation's pages, which it still holds untouched
    assert other_seq.inbound is not None and other_seq.inbound.written_tokens == 0
    assert int(book.engine.pages.book.fill[other.pages[0]]) == 0
    assert book.abort("other") is other_seq and book.engine.pages.num_used == 0


def test_a_payload_of_the_wrong_length_is_refused_before_it_is_read(
    decode: ReceiverFactory,
) -> None:
    book, receiver = decode()
    seq, handle = reserve(book)
    sock = connect(receiver)
    send_hello(sock, handle, receiver.layout)
    payload = page_payload(receiver.layout)
    send_page(sock, 0, handle.pages[0], handle.tags[0], PAGE, payload, nbytes=1 << 40)
    reply = reply_of(sock)
    assert reply["ok"] is False and reply["code"] == "bad_frame", reply
    assert_refused_and_pages_back(book, seq, "bad_frame")


def test_a_page_sent_twice_in_one_transfer_is_refused(decode: ReceiverFactory) -> None:
    """Otherwise the second copy would count its tokens again, and a transfer that skipped a
    page could still add up to the reserved tokens."""
    book, receiver = decode()
    seq, handle = reserve(book)
    layout = receiver.layout
    sock = connect(receiver)
    send_hello(sock, handle, layout)
    payload = page_payload(layout)
    send_page(sock, 0, handle.pages[0], handle.tags[0], PAGE, payload)
    send_page(sock, 0, handle.pages[0], handle.tags[0], PAGE, payload)
    send_page(sock, 2, handle.pages[2], handle.tags[2], 8, payload)  # 40 tokens in all
    send_end(sock, len(PROMPT))
    reply = reply_of(sock)
    assert reply["ok"] is False and reply["code"] == "bad_frame", reply
    assert "twice" in str(reply["message"])
    assert_refused_and_pages_back(book, seq, "bad_frame")


def test_an_honest_transfer_still_goes_through(decode: ReceiverFactory) -> None:
    """The control for the frame checks: the frames a prefill sends pass every one of them."""
    book, receiver = decode(token=TOKEN)
    seq, handle = reserve(book)
    layout = receiver.layout
    payload = page_payload(layout)
    with Sender(handle, layout, token=TOKEN) as sender:
        views = [
            (memoryview(payload)[: len(payload) // 2], memoryview(payload)[len(payload) // 2 :])
        ]
        sender.send_pages(0, views * 3, [PAGE, PAGE, 8])
        sender.finish(len(PROMPT))
    wait_until_ended(seq)
    assert book.start_decode("r", TokenLogprob(1, 0.0)) is seq and seq.error is None


def test_an_unexpected_error_while_writing_still_ends_the_transfer_and_returns_the_pages(
    decode: ReceiverFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    book, receiver = decode()
    seq, handle = reserve(book)

    def broken_write(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("a bug in the page write")

    monkeypatch.setattr(book.engine.pages, "write_transferred", broken_write)
    sock = connect(receiver)
    send_hello(sock, handle, receiver.layout)
    send_page(sock, 0, handle.pages[0], handle.tags[0], PAGE, page_payload(receiver.layout))
    send_end(sock, len(PROMPT))
    reply = reply_of(sock)
    assert reply["ok"] is False and reply["code"] == "transfer_failed", reply
    assert "bug" not in str(reply["message"])  # the internals stay in the log
    assert_refused_and_pages_back(book, seq, "transfer_failed")


# --- HELLO -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "code"),
    [
        ("s3crét", "unauthorized"),  # non-ASCII: hmac.compare_digest raised TypeError on str
        ("\ud800", "unauthorized"),  # a lone surrogate, as JSON allows
        (5, "unauthorized"),
        (None, "unauthorized"),
    ],
)
def test_a_hello_with_a_wrong_or_malformed_token_is_told_unauthorized(
    decode: ReceiverFactory, token: object, code: str
) -> None:
    book, receiver = decode(token=TOKEN)
    seq, handle = reserve(book)
    sock = connect(receiver)
    send_hello(sock, handle, receiver.layout, token=token)
    reply = reply_of(sock)
    assert reply == {"ok": False, "code": code, "message": "missing or wrong internal token"}
    assert seq.inbound is not None and not seq.inbound.in_flight  # the reservation is untouched
    assert book.abort("r") is seq and book.engine.pages.num_used == 0


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the JSON parser's recursion
        json.dumps({"request_id": "r"}).encode(),
    ],
    ids=["not-json", "not-utf8", "not-an-object", "deeply-nested", "fields-missing"],
)
def test_a_malformed_hello_is_told_bad_frame(decode: ReceiverFactory, body: bytes) -> None:
    _, receiver = decode()
    sock = connect(receiver)
    send_json_frame(sock, body)
    reply = reply_of(sock)
    assert reply["ok"] is False and reply["code"] == "bad_frame", reply


def test_a_connection_that_does_not_say_hello_in_time_is_told_and_closed(
    decode: ReceiverFactory,
) -> None:
    """Slowloris: a byte now and then must not hold a receiver thread past the deadline."""
    _, receiver = decode(hello_timeout=0.5)
    sock = connect(receiver)
    sock.sendall(b"KV")
    time.sleep(0.3)
    sock.sendall(b"F")  # each byte within the idle timeout, the HELLO never complete
    reply = reply_of(sock)
    # the HELLO's deadline said so, not the idle timeout: what it says is the fact, not when
    assert reply["ok"] is False and reply["code"] == "timeout", reply
    assert reply["message"] == "no complete HELLO within 0.5 s", reply


def test_a_prefill_over_the_cap_learns_why_rather_than_a_reset(decode: ReceiverFactory) -> None:
    book, receiver = decode(max_connections=1, hello_timeout=REPLY_WAIT * 4)
    idle = connect(receiver)
    _, handle = reserve(book)
    shape = (3, receiver.layout.layers, PAGE, receiver.layout.kv_heads, receiver.layout.head_dim)
    with pytest.raises(TransferError) as refused:
        send_kv(
            handle, torch.ones(shape), torch.ones(shape), len(PROMPT), receiver.layout, token=None
        )
    assert refused.value.code == "too_many_connections"
    idle.close()


def test_a_sender_cut_short_by_a_refusal_still_reads_the_reason() -> None:
    """Decode refuses and closes while prefill is still sending (here: 64 MiB of pages): the
    send fails with a reset, and prefill reads the reply that arrived before it."""
    server = socket.create_server(("127.0.0.1", 0))

    def refuse_after_hello() -> None:
        conn, _ = server.accept()
        with conn:
            read_frame_header(conn)  # the HELLO
            conn.sendall(reply_bytes(False, "too_many_connections", "busy"))
        # closed with the pages unread: the sender's next send is reset

    threading.Thread(target=refuse_after_hello, daemon=True).start()
    pages = 64
    layout = Layout(1, PAGE, 64, 128, "float32")  # 1 MiB of K and V per page
    handle = Handle("r", 1, list(range(pages)), [1] * pages, pages * PAGE, server.getsockname()[1])
    shape = (pages, 1, PAGE, 64, 128)
    with pytest.raises(TransferError) as refused:
        send_kv(handle, torch.ones(shape), torch.ones(shape), pages * PAGE, layout, token=None)
    assert (refused.value.code, str(refused.value)) == ("too_many_connections", "busy")
    server.close()


def test_connections_over_the_cap_are_refused_with_a_reply_until_one_ends(
    decode: ReceiverFactory,
) -> None:
    book, receiver = decode(max_connections=2, hello_timeout=REPLY_WAIT * 4)
    idle = [connect(receiver), connect(receiver)]  # accepted in order, before the third
    reply = reply_of(connect(receiver))
    assert reply["ok"] is False and reply["code"] == "too_many_connections", reply

    for sock in idle:  # the idle clients go away: their slots come back
        sock.close()
    seq, handle = reserve(book)
    deadline = time.monotonic() + REPLY_WAIT
    while True:
        sock = connect(receiver)
        send_hello(sock, handle, receiver.layout)
        payload = page_payload(receiver.layout)
        for i, tokens in enumerate([PAGE, PAGE, 8]):
            send_page(sock, i, handle.pages[i], handle.tags[i], tokens, payload)
        send_end(sock, len(PROMPT))
        reply = reply_of(sock)
        if reply.get("code") != "too_many_connections" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert reply == {"ok": True, "code": "", "message": ""}
    wait_until_ended(seq)
    assert book.start_decode("r", TokenLogprob(1, 0.0)) is seq
