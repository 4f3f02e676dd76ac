"""Decode reservations: a reserved prompt's pages wait outside the scheduler for their KV, take
only verified writes, and always come back, however the request ends.

In-process: the transfer's pages are handed to the reservations as the receiver would (one
receiver thread per transfer), without sockets."""

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import fields
from types import TracebackType
from unittest import mock

import pytest

from helpers.engines import generate, make_tiny_engine, prompt_of, run_until_done
from helpers.pool_watch import watch_reservations
from kvfence_engine.contracts import ErrorCode
from kvfence_engine.core import errors
from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import (
    InboundKV,
    Request,
    SamplingParams,
    TokenLogprob,
    is_terminal,
)
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.disagg.transfer import Handle, page_views

PAGE = 16  # make_tiny_engine's page size


def decode_side(pages: int = 64, faults: tuple[str, ...] = ()) -> DecodeReservations:
    engine = make_tiny_engine(pages=pages, faults=faults, role="decode")
    return watch_reservations(DecodeReservations(engine))


def admitted(engine: LLMEngine, prompt: list[int], max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    seq = engine.admit(prompt, params, max_tokens=max_tokens)
    assert not is_terminal(seq)
    return seq


def prefilled(prompt: list[int]) -> tuple[list[bytearray], TokenLogprob]:
    """What a prefill engine streams: each page's K then V bytes, and its first token."""
    engine = make_tiny_engine()
    seq = admitted(engine, prompt, max_tokens=1)
    seq.export_kv = True
    engine.add(seq)
    run_until_done(engine)
    assert seq.exported is not None
    k, v, written = seq.exported
    assert written == len(prompt)
    pages = [bytearray(k_page) + bytearray(v_page) for k_page, v_page in page_views(k, v)]
    return pages, TokenLogprob(seq.output_ids[0], 0.0)


def tokens_in(page_index: int, prompt_len: int) -> int:
    return min(PAGE, prompt_len - page_index * PAGE)


def send(
    book: DecodeReservations, handle: Handle, pages: list[bytearray], prompt_len: int
) -> EngineError | None:
    """A whole transfer, as a receiver thread runs it; returns what the sender is told."""
    try:
        seq = book.begin_transfer(handle.request_id, handle.seq_id, handle.pages, handle.tags)
    except EngineError as refused:  # e.g. aborted before the connection arrived
        return refused
    for i, payload in enumerate(pages):
        book.receive_page(
            seq, handle.pages[i], handle.tags[i], tokens_in(i, prompt_len), memoryview(payload)
        )
    return book.end_transfer(seq, None)


def count(engine: LLMEngine, name: str) -> float:
    """A counter's value, read the way Prometheus would (no private state)."""
    return engine.metrics.registry.get_sample_value(f"{name}_total") or 0.0


# --- the whole protocol ----------------------------------------------------------------------


def test_a_reserved_prompt_decodes_from_transferred_kv_as_if_it_had_been_computed_here() -> None:
    book = decode_side()
    engine = book.engine
    prompt = prompt_of(40)
    seq = admitted(engine, prompt, max_tokens=10)
    handle = book.reserve(seq, "r1")
    assert (handle.pages, handle.tags, handle.reserved_tokens) == (seq.pages, seq.page_tags, 40)
    assert engine.pages.num_used == 3
    assert not engine.has_work()  # reserved, not scheduled: the step loop never sees it
    assert book.pending("r1") is seq

    pages, first = prefilled(prompt)
    assert send(book, handle, pages, len(prompt)) is None
    assert book.start_decode("r1", first) is seq
    assert book.pending("r1") is None and engine.has_work()
    run_until_done(engine)

    assert seq.output_ids == generate(make_tiny_engine(), prompt, 10, ignore_eos=True).output_ids
    assert engine.pages.num_used == 0
    book.expire(0.0)  # the loop's housekeeping forgets finished ids: "r1" may be used again
    assert book.abort("r1") is None
    book.reserve(admitted(engine, prompt), "r1")


def test_a_request_id_in_use_is_refused_and_allocates_nothing() -> None:
    book = decode_side()
    book.reserve(admitted(book.engine, prompt_of(40)), "same")
    with pytest.raises(EngineError) as refused:
        book.reserve(admitted(book.engine, prompt_of(20)), "same")
    assert refused.value.status == 400 and "already in use" in refused.value.message
    assert book.engine.pages.num_used == 3


def test_a_reservation_the_pool_cannot_hold_is_overloaded_and_allocates_nothing() -> None:
    book = decode_side(pages=4)
    book.reserve(admitted(book.engine, prompt_of(40)), "first")
    with pytest.raises(EngineError) as refused:
        book.reserve(admitted(book.engine, prompt_of(40)), "second")
    assert refused.value.status == 503 and refused.value.code == "overloaded"
    assert book.engine.pages.num_used == 3
    assert book.pending("second") is None


# --- transfers that go wrong -----------------------------------------------------------------


def test_a_transfer_short_of_the_reserved_tokens_fails_the_request_and_frees_its_pages() -> None:
    book = decode_side()
    prompt = prompt_of(40)
    handle = book.reserve(admitted(book.engine, prompt), "short")
    pages, first = prefilled(prompt)
    error = send(book, handle, pages[:2], len(prompt))  # 32 of 40 tokens
    assert error is not None and error.code == "kv_isolation_violation"
    assert count(book.engine, "kvfence_transfer_count_mismatch") == 1
    with pytest.raises(EngineError) as refused:
        book.start_decode("short", first)
    assert refused.value is error
    assert book.engine.pages.num_used == 0


def test_with_the_count_check_off_a_short_transfer_is_still_stopped_by_the_read_check() -> None:
    """Negative control for the count check: the read check behind it catches the gap."""
    book = decode_side(faults=("skip-count-check",))
    engine = book.engine
    prompt = prompt_of(40)
    seq = admitted(engine, prompt)
    handle = book.reserve(seq, "short")
    pages, first = prefilled(prompt)
    assert send(book, handle, pages[:2], len(prompt)) is None
    book.start_decode("short", first)
    run_until_done(engine)
    assert seq.error is not None and seq.error.code == "kv_isolation_violation"
    assert len(seq.output_ids) == 1  # only prefill's token: nothing from unwritten slots
    assert count(engine, "kvfence_kv_unwritten_read") == 1 and engine.pages.num_used == 0


def test_a_transfer_for_no_reservation_the_wrong_pages_or_a_second_time_is_refused() -> None:
    book = decode_side()
    handle = book.reserve(admitted(book.engine, prompt_of(40)), "r")

    def begin(request_id: str = "r", tags: list[int] = handle.tags) -> int:
        try:
            book.begin_transfer(request_id, handle.seq_id, handle.pages, tags)
        except EngineError as exc:
            return exc.status
        return 200

    assert begin("nobody") == 404
    assert begin(tags=[t + 1 for t in handle.tags]) == 400
    assert begin() == 200
    assert begin() == 409
    # the accepted connection ends as a receiver ends it, short: the reservation fails closed
    seq = book.pending("r")
    assert seq is not None and book.end_transfer(seq, None) is not None


def test_a_request_aborted_mid_transfer_keeps_its_pages_fenced_until_the_transfer_ends() -> None:
    book = decode_side()
    engine = book.engine
    prompt = prompt_of(40)
    seq = admitted(engine, prompt)
    handle = book.reserve(seq, "a")
    pages, _ = prefilled(prompt)
    inbound = book.begin_transfer("a", handle.seq_id, handle.pages, handle.tags)
    assert book.receive_page(inbound, handle.pages[0], handle.tags[0], PAGE, memoryview(pages[0]))

    assert book.abort("a") is seq and seq.finish_reason == "abort"
    assert engine.pages.num_used == 3  # not freed under the writer: fenced
    late = book.receive_page(inbound, handle.pages[1], handle.tags[1], PAGE, memoryview(pages[1]))
    assert not late and count(engine, "kvfence_late_writes_dropped") == 1
    book.end_transfer(inbound, None)
    assert engine.pages.num_used == 0  # released when the transfer ended


def test_decoding_before_the_transfer_has_ended_is_refused_and_the_pages_come_back() -> None:
    book = decode_side()
    prompt = prompt_of(40)
    handle = book.reserve(admitted(book.engine, prompt), "early")
    pages, first = prefilled(prompt)
    inbound = book.begin_transfer("early", handle.seq_id, handle.pages, handle.tags)
    with pytest.raises(EngineError, match="has not completed"):
        book.start_decode("early", first)
    assert book.engine.pages.num_used == 3  # still being written: fenced
    for i, payload in enumerate(pages):
        book.receive_page(
            inbound, handle.pages[i], handle.tags[i], tokens_in(i, 40), memoryview(payload)
        )
    book.end_transfer(inbound, None)
    assert book.engine.pages.num_used == 0


# --- abort and expiry ------------------------------------------------------------------------


def test_aborting_a_reservation_before_its_transfer_frees_its_pages_at_once() -> None:
    book = decode_side()
    seq = admitted(book.engine, prompt_of(40))
    book.reserve(seq, "a")
    assert book.abort("a") is seq and seq.finish_reason == "abort"
    assert book.engine.pages.num_used == 0 and book.pending("a") is None
    assert book.abort("a") is None and book.abort("never-reserved") is None


def test_aborting_a_decoding_request_ends_it_at_the_next_step_with_its_pages() -> None:
    book = decode_side()
    engine = book.engine
    prompt = prompt_of(40)
    seq = admitted(engine, prompt, max_tokens=50)
    handle = book.reserve(seq, "d")
    pages, first = prefilled(prompt)
    send(book, handle, pages, len(prompt))
    book.start_decode("d", first)
    engine.step()
    assert book.abort("d") is seq and seq.finish_reason == "abort"
    engine.step()
    assert engine.pages.num_used == 0 and not engine.has_work()


def test_a_reservation_whose_kv_never_starts_expires_and_returns_its_pages() -> None:
    book = decode_side()
    seq = admitted(book.engine, prompt_of(40))
    book.reserve(seq, "x")
    assert seq.inbound is not None
    deadline = seq.inbound.deadline
    book.expire(deadline)  # not yet
    assert book.pending("x") is seq and book.engine.pages.num_used == 3
    book.expire(deadline + 0.001)
    assert seq.error is not None and (seq.error.status, seq.error.code) == (
        408,
        "reservation_expired",
    )
    assert book.engine.pages.num_used == 0
    with pytest.raises(EngineError) as gone:
        book.start_decode("x", TokenLogprob(1, 0.0))
    assert gone.value.status == 404


def test_a_reservation_is_not_expired_while_its_transfer_is_writing() -> None:
    book = decode_side()
    seq = admitted(book.engine, prompt_of(40))
    handle = book.reserve(seq, "slow")
    inbound = book.begin_transfer("slow", handle.seq_id, handle.pages, handle.tags)
    assert seq.inbound is not None
    later = seq.inbound.deadline + 100
    book.expire(later)
    assert book.pending("slow") is seq and not is_terminal(seq)
    book.end_transfer(inbound, None)
    book.expire(later)  # nobody asked to decode it: now it goes
    assert seq.finish_reason == "error" and book.engine.pages.num_used == 0


# --- lock discipline -------------------------------------------------------------------------


class WatchedLock:
    """Wraps a lock and records, per acquisition, which watched locks the thread held."""

    def __init__(
        self, inner: AbstractContextManager[object], name: str, log: list, held: threading.local
    ) -> None:
        self.inner, self.name, self.log, self.held = inner, name, log, held

    def __enter__(self) -> None:
        self.inner.__enter__()
        stack = self.held.__dict__.setdefault("stack", [])
        self.log.append((self.name, tuple(stack)))
        stack.append(self.name)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.held.stack.pop()
        self.inner.__exit__(kind, error, trace)


@contextmanager
def watched(book: DecodeReservations) -> Iterator[list[tuple[str, tuple[str, ...]]]]:
    log: list[tuple[str, tuple[str, ...]]] = []
    held = threading.local()
    pages = book.engine.pages
    with (  # each lock swapped for one that records its acquisitions, for the block
        mock.patch.object(book, "_lock", WatchedLock(book._lock, "reservations", log, held)),
        mock.patch.object(pages, "lock", WatchedLock(pages.lock, "pool", log, held)),
    ):
        yield log


def test_the_pool_lock_is_only_ever_taken_inside_the_reservations_lock_never_around_it() -> None:
    book = decode_side()
    prompt = prompt_of(40)
    pages, first = prefilled(prompt)
    with watched(book) as log:
        handles = [book.reserve(admitted(book.engine, prompt), f"r{i}") for i in range(3)]
        receivers = [
            threading.Thread(target=send, args=(book, h, pages, len(prompt))) for h in handles
        ]
        for receiver in receivers:
            receiver.start()
        book.abort("r1")
        for receiver in receivers:
            receiver.join()
        book.start_decode("r0", first)
        book.expire(time.monotonic() + 3600)  # r2 was never asked to decode
        run_until_done(book.engine)
    assert ("pool", ("reservations",)) in log  # pages are written and freed under both
    assert not [entry for entry in log if entry[0] == "reservations" and "pool" in entry[1]]
    assert book.engine.pages.num_used == 0


def test_a_page_write_waits_while_another_thread_holds_the_reservation_state() -> None:
    book = decode_side()
    prompt = prompt_of(40)
    handle = book.reserve(admitted(book.engine, prompt), "w")
    pages, _ = prefilled(prompt)
    inbound = book.begin_transfer("w", handle.seq_id, handle.pages, handle.tags)
    page = handle.pages[0]
    writer = threading.Thread(
        target=book.receive_page,
        args=(inbound, page, handle.tags[0], PAGE, memoryview(pages[0])),
    )
    with book._lock:  # as abort would, deciding to fence
        writer.start()
        writer.join(timeout=0.3)
        assert writer.is_alive() and int(book.engine.pages.book.fill[page]) == 0
    writer.join()
    assert int(book.engine.pages.book.fill[page]) == PAGE
    book.end_transfer(inbound, None)  # as the receiver thread does when the connection ends


def test_start_decode_never_sees_a_transfer_half_ended() -> None:
    """Issue 12, finding 7: end_transfer marks a transfer done and then records its error. Both
    happen under the reservations' lock and start_decode reads both under it, so a
    start_decode that arrives in between waits, and refuses the failed transfer instead of
    decoding from it."""
    book = decode_side()
    prompt = prompt_of(40)
    seq = admitted(book.engine, prompt)
    handle = book.reserve(seq, "race")
    _, first = prefilled(prompt)
    inbound = book.begin_transfer("race", handle.seq_id, handle.pages, handle.tags)
    between, go_on = threading.Event(), threading.Event()

    class PausesWhenDone(InboundKV):
        """Stops end_transfer right after `done` is set, before the error is."""

        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, value)
            if name == "done" and value:
                between.set()
                go_on.wait(timeout=10)

    assert seq.inbound is not None
    seq.inbound = PausesWhenDone(
        **{f.name: getattr(seq.inbound, f.name) for f in fields(seq.inbound)}
    )
    failure = errors.transfer_failed("KV transfer failed: reset", ErrorCode.TRANSFER_INCOMPLETE)
    ender = threading.Thread(target=book.end_transfer, args=(inbound, failure))
    ender.start()
    assert between.wait(timeout=10)
    outcome: dict[str, object] = {}

    def start() -> None:
        try:
            outcome["decoding"] = book.start_decode("race", first)
        except EngineError as refused:
            outcome["refused"] = refused

    starter = threading.Thread(target=start)
    starter.start()
    starter.join(timeout=0.5)
    waited = starter.is_alive()  # held off while the transfer was half ended
    go_on.set()
    ender.join(timeout=10)
    starter.join(timeout=10)
    assert outcome == {"refused": failure}
    assert waited
    assert book.engine.pages.num_used == 0


def test_concurrent_transfers_aborts_and_expiry_leave_every_page_free() -> None:
    book = decode_side()
    engine = book.engine
    prompt = prompt_of(40)
    pages, first = prefilled(prompt)
    seqs = [admitted(engine, prompt, max_tokens=4) for _ in range(8)]
    handles = [book.reserve(seq, f"c{i}") for i, seq in enumerate(seqs)]
    results: dict[str, EngineError | None] = {}

    def transfer(handle: Handle) -> None:
        results[handle.request_id] = send(book, handle, pages, len(prompt))

    receivers = [threading.Thread(target=transfer, args=(h,)) for h in handles]
    for receiver in receivers:
        receiver.start()
    for i in range(0, 8, 2):  # abort every other one, wherever its transfer has got to
        book.abort(f"c{i}")
    for receiver in receivers:
        receiver.join()
    for i in range(1, 8, 2):
        assert results[f"c{i}"] is None
        book.start_decode(f"c{i}", first)
    run_until_done(engine)
    book.expire(0.0)
    assert [s.finish_reason for s in seqs] == ["abort", "length"] * 4
    assert engine.pages.num_used == 0
    solo = generate(make_tiny_engine(), prompt, 4, ignore_eos=True).output_ids
    assert all(s.output_ids == solo for s in seqs[1::2])
