"""Runs the engine's step loop on its own thread and streams each request's tokens to asyncio.

Everything that changes scheduler state runs on that thread: callers hand it work through an
inbox of callables and get results back through futures or per-request queues.

Requests that arrive in a burst are prefilled together. An idle engine that gets work keeps
taking what arrives for as long as arrivals keep coming less than GATHER_GAP_S apart (at most
GATHER_MAX_S) before its first step: sixteen clients starting at once are one prefill batch,
not one and then fifteen. A lone request waits one gap (3 ms) for company that never comes.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvfence_engine.contracts import DEFAULT_TENANT
from kvfence_engine.core import errors
from kvfence_engine.core.deltas import Delta
from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import Request, SamplingParams, is_terminal
from kvfence_engine.loading.tokenizer import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")
GATHER_GAP_S = 0.003  # an idle engine's first step waits while arrivals come this close
GATHER_MAX_S = 0.020  # ...and never longer than this


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delta]
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass(slots=True)
class AsyncEngine:
    engine: LLMEngine[Tokenizer]
    _inbox: queue.SimpleQueue[Callable[[], None]] = field(default_factory=queue.SimpleQueue)
    _streams: dict[int, _Stream] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    # Chores for the engine thread after every pass of its loop, given time.monotonic() (the
    # decode role expires reservations here). Add them before start().
    housekeeping: list[Callable[[float], None]] = field(default_factory=list)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvfence-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def admit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int | None,
        tenant: str = DEFAULT_TENANT,
        cache_salt: str | None = None,
    ) -> Request:
        return self.engine.admit(
            prompt_ids, params, max_tokens=max_tokens, tenant=tenant, cache_salt=cache_salt
        )

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread and await its result (or exception)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._inbox.put(run)
        return await future

    async def stream(
        self, seq: Request, start: Callable[[], object] | None = None
    ) -> AsyncGenerator[Delta]:
        """Run a sequence; yields deltas until it finishes. `start` (engine thread) puts it to
        work; by default it joins the scheduler's waiting queue. Closing the iterator early
        (client gone) aborts the sequence and releases its pages."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._streams[seq.seq_id] = stream
        self._inbox.put(lambda: self._start(seq, start))
        finished = False
        try:
            while not finished:
                delta = await stream.queue.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.abort(seq)

    def abort(self, seq: Request) -> None:
        def run() -> None:
            self.engine.abort(seq)
            self._deliver(seq)

        self._inbox.put(run)

    # --- engine thread -----------------------------------------------------------------------

    def _start(self, seq: Request, start: Callable[[], object] | None) -> None:
        try:
            if is_terminal(seq):  # aborted before it ever started
                pass
            elif start is None:
                self.engine.add(seq)
            else:
                start()
        except EngineError as exc:
            seq.finish("error", exc)
        except Exception:  # this request alone: the engine never took it
            incident = errors.new_incident()
            log.exception("incident %s: starting seq %d failed", incident, seq.seq_id)
            seq.finish("error", errors.internal_error(f"incident {incident}"))
        self._deliver(seq)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                idle = not self.engine.has_work()
                self._drain_inbox(block=idle)
                if idle and self.engine.has_work():
                    self._gather()
                if self.engine.has_work():
                    # a failure while running a batch is contained in step(): it fails that
                    # batch alone and reports it here like any other change
                    self._deliver(*self.engine.step())
            except Exception:  # outside any batch: the scheduler's own state is suspect
                incident = errors.new_incident()
                log.exception("incident %s: the engine loop failed; failing all requests", incident)
                self._deliver(*self.engine.fail_all(errors.internal_error(f"incident {incident}")))
            for chore in self.housekeeping:
                try:
                    chore(time.monotonic())
                except Exception:  # its own state; the requests in the scheduler go on
                    log.exception("housekeeping chore %r failed", chore)

    def _gather(self) -> None:
        """Take work while it keeps arriving (a burst), up to GATHER_MAX_S: see the module
        docstring."""
        deadline = time.monotonic() + GATHER_MAX_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                work = self._inbox.get(timeout=min(GATHER_GAP_S, left))
            except queue.Empty:
                return
            self._run_all(work)

    def _drain_inbox(self, block: bool) -> None:
        try:
            work = self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._run_all(work)

    def _run_all(self, work: Callable[[], None]) -> None:
        """Run `work`, then everything else in the inbox."""
        while True:
            try:
                work()
            except Exception:  # each item answers for itself; the rest of the inbox still runs
                log.exception("engine thread work item failed")
            try:
                work = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, *seqs: Request) -> None:
        """Hand each sequence's new tokens (and its end) to its stream: one wake-up of each
        event loop for all of them (a step of 16 rows is one, not 16)."""
        posts: dict[asyncio.AbstractEventLoop, list[tuple[Request, _Stream, Delta]]] = {}
        for seq in seqs:
            with self._lock:
                stream = self._streams.get(seq.seq_id)
                if stream is None:
                    continue
                terminal = is_terminal(seq)
                if terminal:
                    del self._streams[seq.seq_id]
            # A request that failed closed gets no tokens from the failing step (there are none).
            delta = Delta(
                token_ids=seq.output_ids[stream.sent_tokens :],
                logprobs=seq.output_logprobs[stream.sent_logprobs :],
                finish_reason=seq.finish_reason if terminal else None,
                error=seq.error if terminal else None,
            )
            stream.sent_tokens = len(seq.output_ids)
            stream.sent_logprobs = len(seq.output_logprobs)
            if delta.token_ids or terminal:
                posts.setdefault(stream.loop, []).append((seq, stream, delta))
        for loop, items in posts.items():
            try:
                loop.call_soon_threadsafe(_put_all, [(stream, delta) for _, stream, delta in items])
            except RuntimeError:  # its event loop is closed: nobody is left to read them
                for seq, _, _ in items:
                    with self._lock:
                        self._streams.pop(seq.seq_id, None)
                    self.engine.abort(seq)  # released at the next step


def _put_all(items: list[tuple[_Stream, Delta]]) -> None:
    for stream, delta in items:
        stream.queue.put_nowait(delta)


def _set_result(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[T], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
