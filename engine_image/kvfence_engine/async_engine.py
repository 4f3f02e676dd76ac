"""Runs the engine's step loop on its own thread and streams each request's tokens to asyncio."""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from . import errors
from .engine import LLMEngine
from .errors import EngineError
from .sequence import SamplingParams, Sequence, TokenLogprob, is_terminal

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Delta:
    """What a request gained in one step."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    error: EngineError | None = None


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delta]
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass(slots=True)
class AsyncEngine:
    engine: LLMEngine
    _inbox: queue.SimpleQueue[tuple[str, Sequence]] = field(default_factory=queue.SimpleQueue)
    _streams: dict[int, _Stream] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvfence-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def admit(
        self, prompt_ids: list[int], params: SamplingParams, max_tokens: int | None
    ) -> Sequence:
        return self.engine.admit(prompt_ids, params, max_tokens=max_tokens)

    async def stream(self, seq: Sequence) -> AsyncIterator[Delta]:
        """Run an admitted sequence; yields deltas until it finishes. Closing the iterator
        early (client gone) aborts the sequence and releases its pages."""
        assert not is_terminal(seq)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._streams[seq.seq_id] = stream
        self._inbox.put(("add", seq))
        finished = False
        try:
            while not finished:
                delta = await stream.queue.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.abort(seq)

    def abort(self, seq: Sequence) -> None:
        self._inbox.put(("abort", seq))

    # --- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                self._drain_inbox(block=not self.engine.has_work())
                if self.engine.has_work():
                    for seq in self.engine.step():
                        self._deliver(seq)
            except Exception:  # keep serving; fail the requests that were in flight
                log.exception("engine step failed")
                self._fail_all(
                    errors.EngineError(
                        500, "internal engine error", "server_error", "internal_error"
                    )
                )

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, seq = item
            if kind == "add":
                if is_terminal(seq):  # aborted before it was ever scheduled
                    self._deliver(seq)
                else:
                    self.engine.add(seq)
            else:
                self.engine.abort(seq)
                self._deliver(seq)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, error: EngineError) -> None:
        sched = self.engine.scheduler
        for seq in (*sched.waiting, *sched.running):
            seq.finish("error", error)
            self._deliver(seq)
        sched.remove_finished()

    def _deliver(self, seq: Sequence) -> None:
        with self._lock:
            stream = self._streams.get(seq.seq_id)
            if stream is None:
                return
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
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
