"""Continuous batching: each step is either a batch of prefills or a batch of decodes.

A request is in exactly one queue: `waiting` until its prefill is scheduled, `running` from
then on (the prefill's own step included) until it finishes or is preempted, so whatever
happens to a step, the queues know every request and `remove_finished` releases it. Pages are
allocated as sequences grow; when the pool runs dry the youngest running sequence is preempted
(its pages released, its tokens recomputed later).
"""

from collections import deque

from kvfence_engine.core.kv_pool import KVPool
from kvfence_engine.core.request import Request, Status, is_terminal
from kvfence_engine.core.tenants import TenantShares


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        shares: TenantShares | None = None,
    ) -> None:
        self.pool = pool
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
            hit_pages, hit_tags = self._lookup_prefix(seq)
            needed = self.pool.pages_for(seq.num_tokens) - len(hit_pages)
            if needed > self.pool.num_free:
                self.pool.release(seq.seq_id, hit_pages, hit_tags)
                break
            self.waiting.popleft()
            pages, tags = self.pool.allocate(seq.seq_id, needed)
            seq.pages, seq.page_tags = hit_pages + pages, hit_tags + tags
            seq.prefill_start = len(hit_pages) * self.pool.page_size
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(seq)
            tokens += seq.num_tokens
        return batch

    def _lookup_prefix(self, seq: Request) -> tuple[list[int], list[int]]:
        """Cached pages for the leading full pages of the prompt (a reference on each). At
        least one token is always left to compute (its logits give the next token), and a
        partial page is never shared: only full pages have keys."""
        if not seq.cache_keys or seq.placeholder_rejection is not None:
            return [], []
        usable = min(len(seq.cache_keys), (seq.num_tokens - 1) // self.pool.page_size)
        return self.pool.lookup(seq.seq_id, seq.cache_keys[:usable])

    def _schedule_decodes(self) -> list[Request]:
        batch: list[Request] = []
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            if is_terminal(seq):
                continue
            # This step writes the slot of position num_tokens - 1.
            needs_page = len(seq.pages) < self.pool.pages_for(seq.num_tokens)
            while needs_page and self.pool.num_free == 0:
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                if needs_page:
                    page, tag = self.pool.allocate(seq.seq_id, 1)
                    seq.pages += page
                    seq.page_tags += tag
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
        self.pool.release(seq.seq_id, seq.pages, seq.page_tags)
        seq.pages, seq.page_tags = [], []
        seq.num_cached = 0
        seq.prefill_start = 0
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
