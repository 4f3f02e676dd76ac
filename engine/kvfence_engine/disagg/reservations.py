"""Decode side of a disaggregated request: reserve pages, receive their KV, then decode.

A reservation holds the pages of an admitted prompt while prefill streams its KV into them
(begin_transfer, receive_page..., end_transfer) and until the router asks to continue from
prefill's first token (start_decode). Meanwhile the request is not in the scheduler: the step
loop never sees it. abort and expire drop a reservation; pages a transfer is still writing
into are fenced, and released when the transfer ends (deferred release).

Threads and locks. Three kinds of thread call in:
  - the engine thread (AsyncEngine's loop, which also runs `AsyncEngine.call`): reserve,
    start_decode, abort, expire. start_decode hands a request to the scheduler and abort
    finishes a decoding one: only the step loop's thread may touch those;
  - transfer receiver threads, one per connection: begin_transfer, receive_page, end_transfer;
  - any thread (the HTTP event loop): pending.
`self._lock` guards the two maps and the InboundKV of every reserved request; each method
holds it for all the reservation state it reads or changes, so each is atomic against the
others. The page manager's own lock (`PageManager.lock`) still guards the pages: allocation,
release and page writes take it inside its verbs, always after ours (never the other way round:
it never calls back here), so the two cannot deadlock. start_decode continues a request only
once its transfer has ended; from then on no receiver touches it, and it belongs to the engine
thread (continue_decode, and abort of a decoding request, run outside the lock).
"""

import threading
import time

from kvfence_engine.contracts import ErrorCode
from kvfence_engine.core import errors
from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.faults import Fault, write_without_tag_check
from kvfence_engine.core.request import InboundKV, Request, TokenLogprob, is_terminal
from kvfence_engine.disagg.transfer import Handle, TransferError


class DecodeReservations:
    """The decode role's reservations: which request ids are in use, which requests wait
    for their KV or first token, and what each inbound transfer has written."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._reserved: dict[str, Request] = {}  # waiting for their KV or first token
        self._live: dict[str, Request] = {}  # every request id in use: reserved or decoding

    # --- engine thread ---------------------------------------------------------------------

    def reserve(self, seq: Request, request_id: str) -> Handle:
        """Allocate the admitted prompt's pages now and hand out where to write its KV."""
        assert not is_terminal(seq)
        with self._lock:
            live = self._live.get(request_id)
            if live is not None and not is_terminal(live):
                raise errors.invalid_request(f"request id {request_id!r} is already in use")
            self.engine.allocate_prompt(seq)
            n = len(seq.prompt_ids)
            seq.request_id = request_id
            seq.inbound = InboundKV(
                request_id, n, time.monotonic() + self.engine.args.reserve_timeout
            )
            self._reserved[request_id] = seq
            self._live[request_id] = seq
        transfer_port = self.engine.args.transfer_port
        return Handle(request_id, seq.seq_id, seq.pages, seq.page_tags, n, transfer_port)

    def start_decode(self, request_id: str, first: TokenLogprob) -> Request:
        """Continue a reserved request from prefill's first token once its KV is verified."""
        with self._lock:
            seq = self._reserved.pop(request_id, None)
            if seq is None:
                raise errors.unknown_request(f"no reservation {request_id!r} (expired or aborted)")
            inbound = seq.inbound
            assert inbound is not None
            error = inbound.error
            if error is None and not inbound.done:
                error = errors.isolation_violation("its KV transfer has not completed")
            if error is not None:
                self._drop(seq, "error", error)
                raise error
        # out of _reserved: no receiver can reach it any more, the engine thread owns it
        self.engine.continue_decode(seq, first)
        if is_terminal(seq):
            with self._lock:
                self._forget(seq)
        return seq

    def abort(self, request_id: str) -> Request | None:
        """Drop a request by its id, reserved or decoding. Returns it, or None if the id is
        not in use."""
        with self._lock:
            seq = self._live.get(request_id)
            if seq is None or is_terminal(seq):
                return None
            if self._reserved.get(request_id) is seq:
                del self._reserved[request_id]
                self._drop(seq, "abort", None)
                return seq
        self.engine.abort(seq)  # decoding: the scheduler drops it at the next step
        return seq

    def expire(self, now: float) -> None:
        """Drop reservations whose KV never started arriving in time, and forget the ids of
        requests that have finished decoding."""
        with self._lock:
            for request_id, seq in list(self._reserved.items()):
                inbound = seq.inbound
                assert inbound is not None
                if now > inbound.deadline and not inbound.in_flight:
                    del self._reserved[request_id]
                    self._drop(seq, "error", errors.reservation_expired())
            for seq in [s for s in self._live.values() if is_terminal(s)]:
                self._forget(seq)

    # --- any thread ------------------------------------------------------------------------

    def pending(self, request_id: str) -> Request | None:
        """The reserved request with this id, if it still waits for its first token."""
        with self._lock:
            return self._reserved.get(request_id)

    # --- receiver threads ------------------------------------------------------------------

    def begin_transfer(
        self, request_id: str, seq_id: int, pages: list[int], tags: list[int]
    ) -> Request:
        """Match an inbound connection to its reservation."""
        with self._lock:
            seq = self._reserved.get(request_id)
            if seq is None or seq.inbound is None or is_terminal(seq):
                raise errors.unknown_request(f"no reservation {request_id!r}")
            if (seq.seq_id, seq.pages, seq.page_tags) != (seq_id, pages, tags):
                raise errors.handle_mismatch()
            if seq.inbound.in_flight or seq.inbound.done:
                raise errors.duplicate_transfer()
            seq.inbound.in_flight = True
            return seq

    def receive_page(
        self, seq: Request, page: int, tag: int, tokens: int, payload: memoryview
    ) -> bool:
        """Write one verified page; a write for a fenced request or under a stale tag is
        dropped and counted, a page written twice is refused (TransferError). Under the lock,
        so an abort cannot fence the request between the check and the write."""
        inbound = seq.inbound
        assert inbound is not None
        late_write = Fault.LATE_WRITE in self.engine.faults
        metrics = self.engine.metrics
        with self._lock:
            if inbound.fenced and not late_write:
                metrics.late_writes_dropped.inc()
                return False
            # A page sent twice would count its tokens twice, so a transfer that skipped a page
            # could still add up. (The writes of a dropped request are the late-write path
            # above: fenced, or under the fault, applied blindly as the bug was.)
            if page in inbound.pages_written and not is_terminal(seq):
                raise TransferError(
                    ErrorCode.BAD_FRAME, f"page {page} was sent twice in one transfer"
                )
            if late_write:  # the fault: applied blindly, whoever holds the page now
                written = write_without_tag_check(self.engine.pages, page, tag, tokens, payload)
            else:
                written = self.engine.pages.write_transferred(seq, page, tag, tokens, payload)
            if written:
                inbound.written_tokens += tokens
                inbound.pages_written.add(page)
            else:
                metrics.late_writes_dropped.inc()
            return written

    def end_transfer(self, seq: Request, error: EngineError | None) -> EngineError | None:
        """The connection is over. Unless it failed already, compare the tokens written with
        the tokens reserved. Releases now if it was fenced meanwhile. Returns the request's
        transfer error, if any (what the sender is told)."""
        inbound = seq.inbound
        assert inbound is not None
        with self._lock:
            short = inbound.written_tokens != inbound.reserved_tokens
            if error is None and short and Fault.SKIP_COUNT_CHECK not in self.engine.faults:
                self.engine.metrics.count_mismatch.inc()
                error = errors.isolation_violation(
                    f"KV for {inbound.written_tokens} of {inbound.reserved_tokens} reserved "
                    "tokens arrived"
                )
            inbound.in_flight = False
            inbound.done = True
            inbound.error = inbound.error or error
            if inbound.fenced:
                self.engine.release(seq)
            return inbound.error

    # --- under self._lock ------------------------------------------------------------------

    def _drop(self, seq: Request, reason: str, error: EngineError | None) -> None:
        """Finish a request taken out of `_reserved`. Pages with a transfer still writing into
        them are fenced (released when it ends) rather than freed under it: deferred release."""
        seq.finish(reason, error)
        self._forget(seq)
        inbound = seq.inbound
        assert inbound is not None
        if inbound.in_flight and Fault.LATE_WRITE not in self.engine.faults:
            inbound.fenced = True
        else:
            self.engine.release(seq)

    def _forget(self, seq: Request) -> None:
        assert seq.request_id is not None
        if self._live.get(seq.request_id) is seq:
            del self._live[seq.request_id]
