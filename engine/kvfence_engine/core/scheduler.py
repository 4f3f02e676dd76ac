"""Continuous batching: each step is either a batch of prefills or a batch of decodes.

A request is in exactly one queue: `waiting` until its prefill is scheduled, `running` from
then on (the prefill's own step included) until it finishes or is preempted, so whatever
happens to a step, the queues know every request and `remove_finished` releases it. Pages come
from the page manager's verbs (core/page_manager) as sequences grow; when the pool runs dry the
youngest running sequence is preempted (its pages released, its tokens recomputed later).
"""

from collections import deque

from kvfence_engine.core.page_manager import PageManager
from kvfence_engine.core.request import Request, Status, is_terminal
from kvfence_engine.core.tenants import TenantShares


class Scheduler:
    def __init__(
        self,
        pages: PageManager,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        shares: TenantShares | None = None,
    ) -> None:
        self.pages = pages
        self.shares = shares
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: deque[Request] = deque()
        self.preemptions = 0

    def add(self, seq: Request) -> None:
        assert not is_terminal(seq), "a finished request must never reach the scheduler"
        self.waiting.append(seq)

    def add_running(self, seq: Request) -> None:
        """A request whose prompt KV is already in its pages (written by a transfer, not
        computed here) joins the running set to decode from its first token."""
        assert not is_terminal(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def queued(self) -> list[Request]:
        """Every request the scheduler holds: waiting or running."""
        return [*self.waiting, *self.running]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def take_preemptions(self) -> int:
        """Preemptions since the last call (for the counter)."""
        count, self.preemptions = self.preemptions, 0
        return count

    def schedule(self) -> tuple[list[Request], bool]:
        """Pick the next batch. Returns (sequences, is_prefill); each is in `running`."""
        prefills = self._schedule_prefills()
        if prefills:
            return prefills, True
        return self._schedule_decodes(), False

    def _schedule_prefills(self) -> list[Request]:
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if is_terminal(seq):
                self.waiting.popleft()
                continue
            if batch and tokens + seq.num_tokens > self.max_batched_tokens:
                break
            if not self.pages.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(seq)
            tokens += seq.num_tokens
        return batch

    def _schedule_decodes(self) -> list[Request]:
        batch: list[Request] = []
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            if is_terminal(seq):
                continue
            # This step writes the slot of position num_tokens - 1.
            while not self.pages.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.pages.may_append(seq)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch

    def _preempt(self, seq: Request) -> None:
        self.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def release(self, seq: Request) -> None:
        """Return a request's pages. Every finished request passes here (and a preempted one,
        which keeps its tenant's reservation): the one place a reservation is given back."""
        self.pages.deallocate(seq)
        if self.shares is not None and is_terminal(seq):
            self.shares.give_back(seq.seq_id)

    def remove_finished(self) -> list[Request]:
        """Drop terminal sequences from both queues, releasing their pages."""
        done = [s for s in (*self.waiting, *self.running) if is_terminal(s)]
        for seq in done:
            self.release(seq)
        self.waiting = deque(s for s in self.waiting if not is_terminal(s))
        self.running = deque(s for s in self.running if not is_terminal(s))
        return done
