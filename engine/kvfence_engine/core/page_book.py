"""Page bookkeeping: each page's generation tag, fill count, owner and tenant, the free list and
the prefix cache's LRU. Plain data on the host, and what the read check (core/isolation)
consults; the keys and values are in core/kv_cache. Only core/page_manager changes it, under
its lock, and it never calls back.

Release never zeroes a page (that is what makes the pool fast and what makes isolation a
bookkeeping problem) unless `on_free` scrubs it.

Prefix cache: a full prompt page a request wrote may be published under its key
(core/prefix_cache). It is then SHARED: read-only, reference-counted, and carrying its tenant,
which the read check compares with every reader's. Eviction bumps a page's tag, so a (page,
tag) anyone still remembers can never be read again.

The cache is a partition of the pool whose occupancy no other tenant's answer depends on
(docs/isolation.md, invariant 11): `cache_pages` of the pool are the cache's, and an
allocation never takes one (it has the other pages, `num_free` of them, whatever the cache
holds). The partition has `cache_tenants` slots of `quota` pages each. A tenant takes a free
slot when it first publishes; past its quota it evicts its own least recently used page, never
another tenant's; a page no request has used for `cache_idle_seconds` leaves the cache, and a
tenant with no page left gives its slot back. So whether a tenant's page is still cached
depends only on what that tenant did and on the clock; what another tenant can learn is only
whether a slot was free when it first published.
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvfence_engine.core.faults import EarlyRelease

FREE = -1
SHARED = -2  # owner of a published prefix-cache page: readers hold references, not the page
NO_TENANT = -1  # page_tenant of a page that is not shared


class PoolExhausted(RuntimeError):
    pass


@dataclass(slots=True)
class TenantCache:
    """One tenant's slot in the cache partition: how many shared pages it holds (referenced or
    not) and the unreferenced ones, least recently used first, with when each was let go."""

    pages: int = 0
    idle: OrderedDict[int, float] = field(default_factory=OrderedDict)


class PageBook:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        on_free: Callable[[list[int]], None] | None = None,
        early_release: EarlyRelease | None = None,
        cache_pages: int = 0,
        cache_tenants: int = 1,
        cache_idle_seconds: float = float("inf"),
        clock: Callable[[], float] = time.monotonic,
        shared_eviction: bool = False,
    ) -> None:
        assert num_pages > 0 and page_size > 0
        assert 0 <= cache_pages < num_pages and cache_tenants > 0
        self.num_pages = num_pages
        self.page_size = page_size
        self.tags = torch.zeros(num_pages, dtype=torch.int64)
        self.fill = torch.zeros(num_pages, dtype=torch.int64)
        self.owner = torch.full((num_pages,), FREE, dtype=torch.int64)
        # The tag under which each page's slots were written: a write that lands under an old
        # tag (a late transfer write) leaves the page unreadable for its new owner.
        self.written_tag = torch.zeros(num_pages, dtype=torch.int64)
        # LIFO: a just-freed page is the next one handed out (cache-warm, and the worst case
        # for isolation, which is what the tests want to exercise).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.stale_releases = 0
        # Prefix cache: the tenant (interned id) of each shared page, its references, its key.
        self.page_tenant = torch.full((num_pages,), NO_TENANT, dtype=torch.int64)
        self.holders: dict[int, set[int]] = {}  # shared page -> the owners holding a reference
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._tenant_ids: dict[str, int] = {}
        self.cache_pages = cache_pages
        self.cache_tenants = cache_tenants
        self.quota = cache_pages // cache_tenants
        self._caches: dict[int, TenantCache] = {}  # tenant id -> its slot
        self._idle_seconds = cache_idle_seconds
        self._clock = clock
        self._shared_eviction = shared_eviction  # the shared-cache-eviction fault
        self.evictions = 0
        self._on_free = on_free  # pages going back to the free list (--scrub-on-free)
        self._early_release = early_release  # the fault's order of taking free pages
        # Pages whose tag, fill, written tag or tenant changed since take_changes (None: not
        # tracked): what a device copy of them (core/device_decode) must copy again.
        self._changes: list[torch.Tensor] | None = None

    def take_free_through(self, hook: EarlyRelease) -> None:
        """The early-release fault, switched on in a running engine (core/faults.py::RUNTIME)."""
        self._early_release = hook

    # --- what changed, for a copy of the read check's state on a device ------------------

    def track_changes(self) -> None:
        """From now on, remember which pages' read-check state changes."""
        self._changes = []

    def _touch(self, pages: torch.Tensor | list[int] | int) -> None:
        if self._changes is not None:
            self._changes.append(torch.as_tensor(pages, dtype=torch.int64).view(-1))

    def take_changes(self) -> torch.Tensor | None:
        """The pages whose read-check state changed since the last call (unique), or None."""
        if not self._changes:
            return None
        changed = torch.cat(self._changes).unique()
        self._changes = []
        return changed

    def read_state(
        self, pages: torch.Tensor | None = None, dtype: torch.dtype = torch.int32
    ) -> torch.Tensor:
        """[4, len(pages)] (every page if None): each page's tag, fill, written tag and
        tenant, the rows of core/paged_decode's pool state. Tags are compared for equality
        only, so their low 32 bits decide as the full ones do (int64: the tags themselves)."""
        rows = (self.tags, self.fill, self.written_tag, self.page_tenant)
        if pages is None:
            return torch.stack(rows).to(dtype)
        return torch.stack([r[pages] for r in rows]).to(dtype)

    @property
    def num_free(self) -> int:
        """Pages an allocation can have now: the free ones outside the cache's partition (the
        pages the cache holds are its own; the rest of its partition is kept free for it)."""
        if self._shared_eviction:  # the fault: every free and every idle cached page
            return len(self._free) + sum(len(c.idle) for c in self._caches.values())
        return len(self._free) - (self.cache_pages - len(self._key_of))

    @property
    def cache_slots_taken(self) -> int:
        return len(self._caches)

    @property
    def num_cached(self) -> int:
        """Shared (prefix-cache) pages, referenced or not."""
        return len(self._key_of)

    def tenant_id(self, tenant: str) -> int:
        """The interned id the read check compares (ids are never reused)."""
        return self._tenant_ids.setdefault(tenant, len(self._tenant_ids))

    def allocate(self, owner: int, count: int) -> tuple[list[int], list[int]]:
        """Hand out `count` pages to `owner`, all or nothing. Returns (page ids, tags)."""
        assert owner not in (FREE, SHARED)
        if count > self.num_free:
            raise PoolExhausted(f"need {count} pages, {self.num_free} free")
        if count == 0:
            return [], []
        while self._shared_eviction and count > len(self._free):
            self._evict(self._least_recently_used())
        if self._early_release is not None:
            pages = self._early_release.take_free(self._free, owner, count)
        else:
            pages = [self._free.pop() for _ in range(count)]
        idx = torch.tensor(pages)
        assert bool((self.owner[idx] == FREE).all()), "free list held a live page"
        self.tags[idx] += 1
        self.fill[idx] = 0
        self.owner[idx] = owner
        self._touch(idx)
        return pages, self.tags[idx].tolist()

    def _evict(self, page: int) -> None:
        assert not self.holders[page] and int(self.owner[page]) == SHARED
        self._uncache(page)
        self.tags[page] += 1  # whoever remembers (page, old tag) can never read it again
        self.owner[page] = FREE
        self.fill[page] = 0
        self._touch(page)
        if self._on_free is not None:
            self._on_free([page])
        self._free.append(page)
        self.evictions += 1

    def _uncache(self, page: int) -> None:
        del self._by_key[self._key_of.pop(page)]
        self.holders.pop(page, None)
        tenant = int(self.page_tenant[page])
        self.page_tenant[page] = NO_TENANT
        self._touch(page)
        cache = self._caches[tenant]
        cache.pages -= 1
        cache.idle.pop(page, None)
        if not cache.pages:
            del self._caches[tenant]  # its slot is free for any tenant

    def expire(self) -> int:
        """Evict every cached page no request has used for cache_idle_seconds (the clock's
        doing, nobody else's). Returns how many."""
        deadline = self._clock() - self._idle_seconds
        stale = [
            page
            for cache in self._caches.values()
            for page, idle_since in cache.idle.items()
            if idle_since <= deadline
        ]
        for page in stale:
            self._evict(page)
        return len(stale)

    def _least_recently_used(self) -> int:
        """The idle cached page, of any tenant, let go the longest ago (the fault's victim)."""
        oldest = [next(iter(c.idle.items())) for c in self._caches.values() if c.idle]
        return min(oldest, key=lambda item: item[1])[0]

    def _slot(self, tenant: int) -> TenantCache | None:
        """The tenant's slot, with room for one more page: its own least recently used page
        makes room when it is at its quota. None: no free slot, or all its pages are in use."""
        cache = self._caches.get(tenant)
        if cache is not None and cache.pages >= self.quota:
            if not cache.idle:
                return None
            self._evict(next(iter(cache.idle)))
            cache = self._caches.get(tenant)  # None if that was its last page
        if cache is None:
            if len(self._caches) >= self.cache_tenants or not self.quota:
                return None
            cache = self._caches[tenant] = TenantCache()
        return cache

    def lookup(self, owner: int, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """The longest run of leading keys that are cached: `owner` takes a reference on each
        page; returns (pages, tags). The key decides the hit; the read check decides the read."""
        assert owner not in (FREE, SHARED)
        self.expire()
        pages: list[int] = []
        for key in keys:
            page = self._by_key.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            assert owner not in self.holders[page], "a request referenced a page twice"
            self.holders[page].add(owner)
            self._caches[int(self.page_tenant[page])].idle.pop(page, None)
        return pages, [int(self.tags[p]) for p in pages]

    def publish(
        self, owner: int, pages: list[int], tags: list[int], keys: list[bytes], tenant: int
    ) -> int:
        """Make full pages `owner` wrote shared under `keys`; the owner keeps a reference under
        the same tag. A page not fully written by `owner` under its tag, or whose key is
        already cached (by another request), stays private, as do the pages past the tenant's
        quota when all its cached pages are in use, and all of them when no slot is free.
        Returns how many were published."""
        published = 0
        self.expire()
        for page, tag, key in zip(pages, tags, keys, strict=True):
            if (
                key in self._by_key
                or int(self.owner[page]) != owner
                or int(self.tags[page]) != tag
                or int(self.written_tag[page]) != tag
                or int(self.fill[page]) != self.page_size
            ):
                continue
            cache = self._slot(tenant)
            if cache is None:
                break
            cache.pages += 1
            self.owner[page] = SHARED
            self.page_tenant[page] = tenant
            self._touch(page)
            self.holders[page] = {owner}
            self._by_key[key] = page
            self._key_of[page] = key
            published += 1
        return published

    def holds(self, owner: int, pages: list[int], tags: list[int]) -> torch.Tensor:
        """Which of these (page, tag) pairs are still live for `owner` (a shared page: live
        for every holder of a reference under its tag)."""
        idx = torch.tensor(pages, dtype=torch.int64)
        referenced = torch.tensor([owner in self.holders.get(p, ()) for p in pages])
        mine = (self.owner[idx] == owner) | ((self.owner[idx] == SHARED) & referenced)
        return mine & (self.tags[idx] == torch.tensor(tags))

    def release(self, owner: int, pages: list[int], tags: list[int]) -> int:
        """Return pages to the free list. A (page, tag) the owner no longer holds is left
        alone (someone else owns it now) and counted. A shared page loses one reference and, at
        none, joins the LRU. Returns how many (page, tag) pairs were live and released."""
        if not pages:
            return 0
        live = self.holds(owner, pages, tags)
        self.stale_releases += int((~live).sum())
        freed = []
        for page, ok in zip(pages, live.tolist(), strict=True):
            if not ok:
                continue
            if int(self.owner[page]) == SHARED:
                self.holders[page].discard(owner)
                if not self.holders[page]:  # still cached, idle from now
                    self._caches[int(self.page_tenant[page])].idle[page] = self._clock()
            else:
                freed.append(page)
        if freed:
            if self._on_free is not None:
                self._on_free(freed)
            idx = torch.tensor(freed)
            self.owner[idx] = FREE
            self.fill[idx] = 0
            self._touch(idx)
            self._free.extend(freed)
        return int(live.sum())

    def free_in_use(self, pages: list[int]) -> None:
        """Put pages on the free list while their owner still uses them: the early-release
        fault's bug (core/faults.py::EarlyRelease), and nothing else. A shared page leaves the
        cache with it."""
        for page in pages:
            if int(self.owner[page]) == SHARED:
                self._uncache(page)
        self.owner[torch.tensor(pages)] = FREE
        self._free.extend(pages)

    def may_write(self, owner: int, page: int, tag: int) -> bool:
        """Whether `owner` holds `page` privately under `tag` (a transfer write's check)."""
        return int(self.owner[page]) == owner and int(self.tags[page]) == tag

    def mark_written(self, page: int, tag: int, tokens: int) -> None:
        """A transfer wrote the first `tokens` slots of `page` under `tag`."""
        self.fill[page] = tokens
        self.written_tag[page] = tag
        self._touch(page)

    def record_writes(self, slot_pages: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        """After a forward pass wrote these slots, raise each page's fill to cover them."""
        self.fill.scatter_reduce_(0, slot_pages, slot_offsets + 1, reduce="amax")
        self.written_tag[slot_pages] = self.tags[slot_pages]
        self._touch(slot_pages)
