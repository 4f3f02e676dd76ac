"""The one owner of every request's page table: the pages it holds and the tags it holds them
under (`Request.pages`, `Request.page_tags`). Nothing else writes them.

The scheduler and the engine ask through verbs, as nano-vllm's scheduler asks its block
manager: `allocate` a prefill's pages (its cached prefix included), `can_append` and
`may_append` as decode grows, `deallocate` when a request finishes or is preempted; after a
prefill, `publish` its full pages to the prefix cache and `export` their KV for a transfer; on
decode, `write_transferred` writes a page that came over the transfer port.

Below it: the pages' bookkeeping (core/page_book: tags, fills, owners, free list, the prefix
cache's partition)
and their keys and values (core/kv_cache). Allocation, release and transfer writes come from
the engine thread and from transfer receiver threads, so each verb that changes the
bookkeeping holds `lock`.
"""

import threading
from typing import Protocol

import torch

from kvfence_engine.core.faults import EarlyRelease
from kvfence_engine.core.kv_cache import KVCache
from kvfence_engine.core.page_book import PageBook, PoolExhausted
from kvfence_engine.core.pool_plan import CachePartition
from kvfence_engine.core.request import Request


class Peers(Protocol):
    """The other ranks' pools, as rank 0's page manager reaches them (core/leader.Leader)."""

    def wrote(self, page: int, tag: int, tokens: int, payload: memoryview) -> None:
        """A transferred page was written here: write it in theirs too."""

    def join_export(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's exported heads joined with theirs of the same pages: every KV head."""


def export_pages(pages: "PageManager", seq: Request, tokens: int) -> list[int]:
    """The pages that hold a request's first `tokens` slots: what an export copies."""
    return seq.pages[: pages.pages_for(tokens)]


class PageManager:
    def __init__(
        self,
        kv: KVCache,
        *,
        scrub_on_free: bool = False,
        early_release: EarlyRelease | None = None,
        cache: CachePartition | None = None,
        shared_cache_eviction: bool = False,
    ) -> None:
        self.kv = kv
        cache = cache or CachePartition()
        # the pages requests hold; the prefix cache's partition is not theirs (core/page_book)
        self.num_pages = kv.num_pages - cache.pages
        self.page_size = kv.page_size
        self.book = PageBook(
            kv.num_pages,
            self.page_size,
            on_free=kv.scrub if scrub_on_free else None,
            early_release=early_release,
            cache_pages=cache.pages,
            cache_tenants=cache.tenants,
            cache_idle_seconds=cache.idle_seconds,
            shared_eviction=shared_cache_eviction,
        )
        self.scrub_on_free = scrub_on_free
        self.lock = threading.RLock()
        # the other ranks of a tensor-parallel engine (core/leader.py): None alone
        self.peers: Peers | None = None

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def cache_pages(self) -> int:
        """The prefix cache's partition of the pool (0: no cache)."""
        return self.book.cache_pages

    @property
    def num_free(self) -> int:
        """Pages an allocation can have now (never the prefix cache's)."""
        return self.book.num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Shared (prefix-cache) pages, referenced or not."""
        return self.book.num_cached

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def tenant_id(self, tenant: str) -> int:
        """The interned id of a tenant, as the read check compares it with a page's."""
        with self.lock:
            return self.book.tenant_id(tenant)

    def take_stale_releases(self) -> int:
        """Stale (page, tag) releases since the last call (for the counter)."""
        with self.lock:
            count, self.book.stale_releases = self.book.stale_releases, 0
            return count

    # --- a request's page table ------------------------------------------------------------

    def allocate(self, seq: Request) -> bool:
        """Pages for all of a request's tokens, or none (False: the pool cannot hold it now,
        and nothing changed): a reference on each cached page of its prompt's prefix, fresh
        pages for the rest. The prefill then computes from `seq.prefill_start` on."""
        assert not seq.pages, "a request's pages are allocated once, then grown"
        with self.lock:
            hit_pages, hit_tags = self._cached_prefix(seq)
            try:
                needed = self.pages_for(seq.num_tokens) - len(hit_pages)
                pages, tags = self.book.allocate(seq.seq_id, needed)
            except PoolExhausted:
                self.book.release(seq.seq_id, hit_pages, hit_tags)
                return False
        seq.pages, seq.page_tags = hit_pages + pages, hit_tags + tags
        seq.table_epoch += 1
        seq.prefill_start = len(hit_pages) * self.page_size
        return True

    def _cached_prefix(self, seq: Request) -> tuple[list[int], list[int]]:
        """Cached pages for the leading full pages of the prompt (a reference on each). At
        least one token is always left to compute (its logits give the next token), and a
        partial page is never shared: only full pages have keys."""
        if not seq.cache_keys or seq.placeholder_rejection is not None:
            return [], []
        usable = min(len(seq.cache_keys), (seq.num_tokens - 1) // self.page_size)
        return self.book.lookup(seq.seq_id, seq.cache_keys[:usable])

    def can_append(self, seq: Request) -> bool:
        """Whether the request's next step has a slot: its pages cover the position it writes
        (num_tokens - 1), or a page is free to grow into."""
        return not self._needs_page(seq) or self.num_free > 0

    def may_append(self, seq: Request) -> None:
        """Grow the request by a page if its next step writes past its last one."""
        if self._needs_page(seq):
            with self.lock:
                page, tag = self.book.allocate(seq.seq_id, 1)
            seq.pages += page
            seq.page_tags += tag

    def _needs_page(self, seq: Request) -> bool:
        return len(seq.pages) < self.pages_for(seq.num_tokens)

    def deallocate(self, seq: Request) -> int:
        """Give back every page the request holds, and forget what was in them. A (page, tag)
        it no longer holds (someone else's now) is left alone and counted stale. Returns how
        many were live and given back."""
        with self.lock:
            released = self.book.release(seq.seq_id, seq.pages, seq.page_tags)
        seq.pages, seq.page_tags = [], []
        seq.table_epoch += 1
        seq.num_cached = 0
        seq.prefill_start = 0
        return released

    # --- what a prefill leaves, and what a transfer brings ---------------------------------

    def publish(self, seq: Request) -> int:
        """After its prefill: the full prompt pages the request computed (past the cached ones
        it read) become shared under their keys. Returns how many did."""
        full = len(seq.cache_keys)
        if not full or seq.placeholder_rejection is not None or seq.error is not None:
            return 0
        first = seq.prefill_start // self.page_size
        with self.lock:
            return self.book.publish(
                seq.seq_id,
                seq.pages[first:full],
                seq.page_tags[first:full],
                seq.cache_keys[first:full],
                self.book.tenant_id(seq.tenant),
            )

    def export(self, seq: Request, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy out the KV of the request's first `tokens` slots, as host tensors
        [pages, layers, page_size, heads, dim], every KV head of the model (with tensor
        parallelism, the ranks' parts joined: `peers`)."""
        k, v = self.kv.export(export_pages(self, seq, tokens))
        return (k, v) if self.peers is None else self.peers.join_export(k, v)

    def write_transferred(
        self, seq: Request, page: int, tag: int, tokens: int, payload: memoryview
    ) -> bool:
        """Write a transferred page (K then V bytes, a full page, `tokens` slots valid) into one
        of the request's pages. Only if the request still holds the page under `tag`; otherwise
        nothing is written (False)."""
        with self.lock:
            if not self.book.may_write(seq.seq_id, page, tag):
                return False
            self.write_page(page, tag, tokens, payload)
            return True

    def write_page(self, page: int, tag: int, tokens: int, payload: memoryview) -> None:
        """(under `lock`) Write a transferred page and record it written under `tag`, with no
        check of who holds it (write_transferred's, or the late-write fault's missing one);
        with tensor parallelism the other ranks write it too, before their next step."""
        self.kv.write(page, tokens, payload)
        self.book.mark_written(page, tag, tokens)
        if self.peers is not None:
            self.peers.wrote(page, tag, tokens, payload)

    def track_state(self) -> torch.Tensor:
        """(for a device copy of the read check's state, core/device_decode) Every page's
        tag, fill, written tag and tenant now (PageBook.read_state); from now on, which
        pages' state changes is remembered for take_changes."""
        with self.lock:
            self.book.track_changes()
            return self.book.read_state()

    def take_changes(
        self, dtype: torch.dtype = torch.int32
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pages whose read-check state changed since the last call (or track_state),
        and their state now (PageBook.read_state); None if none did."""
        with self.lock:
            changed = self.book.take_changes()
            return None if changed is None else (changed, self.book.read_state(changed, dtype))

    def record_writes(self, slot_pages: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        """A forward pass wrote these slots: their pages' fill counts cover them now."""
        self.book.record_writes(slot_pages, slot_offsets)
