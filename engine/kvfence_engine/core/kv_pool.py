"""The paged KV pool: fixed-size pages, each with a generation tag, a fill count and an owner.

Release never zeroes a page (that is what makes the pool fast and what makes isolation a
bookkeeping problem) unless scrub_on_free is set.

Prefix cache: a full prompt page a request wrote may be published under its key
(core/prefix_cache). It is then SHARED: read-only, reference-counted, and carrying its tenant,
which the read check compares with every reader's. A shared page no request references sits in
an LRU; allocation evicts from it when the free list is empty, and eviction bumps its tag, so a
(page, tag) anyone still remembers can never be read again.
"""

import threading
from collections import OrderedDict

import torch

FREE = -1
SHARED = -2  # owner of a published prefix-cache page: readers hold references, not the page
NO_TENANT = -1  # page_tenant of a page that is not shared


class PoolExhausted(RuntimeError):
    pass


class KVPool:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scrub_on_free: bool = False,
    ) -> None:
        assert num_pages > 0 and page_size > 0
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages
        self.scrub_on_free = scrub_on_free
        # Bookkeeping lives on the host: it is what the read check consults.
        self.tags = torch.zeros(num_pages, dtype=torch.int64)
        self.fill = torch.zeros(num_pages, dtype=torch.int64)
        self.owner = torch.full((num_pages,), FREE, dtype=torch.int64)
        # The tag under which each page's slots were written: a write that lands under an old
        # tag (a late transfer write) leaves the page unreadable for its new owner.
        self.written_tag = torch.zeros(num_pages, dtype=torch.int64)
        # LIFO: a just-freed page is the next one handed out (cache-warm, and the worst case
        # for isolation, which is what the tests want to exercise).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        # The early-release fault's pages on the free list: page -> the owner still using it.
        self._robbed: dict[int, int] = {}
        self.stale_releases = 0
        # Prefix cache: the tenant (interned id) of each shared page, its references, its key.
        self.page_tenant = torch.full((num_pages,), NO_TENANT, dtype=torch.int64)
        self.holders: dict[int, set[int]] = {}  # shared page -> the owners holding a reference
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced shared pages, oldest first
        self._tenant_ids: dict[str, int] = {}
        self.evictions = 0
        # Allocation, release and transfer writes may come from the engine thread and from
        # transfer receiver threads; the bookkeeping changes under this lock.
        self.lock = threading.RLock()

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        """Pages an allocation can have now: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Shared (prefix-cache) pages, referenced or not."""
        return len(self._key_of)

    def tenant_id(self, tenant: str) -> int:
        """The interned id the read check compares (ids are never reused)."""
        with self.lock:
            return self._tenant_ids.setdefault(tenant, len(self._tenant_ids))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def take_stale_releases(self) -> int:
        """Stale (page, tag) releases since the last call (for the counter)."""
        with self.lock:
            count, self.stale_releases = self.stale_releases, 0
            return count

    def allocate(self, owner: int, count: int) -> tuple[list[int], list[int]]:
        """Hand out `count` pages to `owner`, all or nothing. Returns (page ids, tags)."""
        with self.lock:
            return self._allocate(owner, count)

    def _allocate(self, owner: int, count: int) -> tuple[list[int], list[int]]:
        assert owner not in (FREE, SHARED)
        if count > self.num_free:
            raise PoolExhausted(f"need {count} pages, {self.num_free} free")
        if count == 0:
            return [], []
        while count > len(self._free):
            self._evict_one()
        pages = self._pop_free(owner, count)
        idx = torch.tensor(pages)
        assert bool((self.owner[idx] == FREE).all()), "free list held a live page"
        self.tags[idx] += 1
        self.fill[idx] = 0
        self.owner[idx] = owner
        return pages, self.tags[idx].tolist()

    def _pop_free(self, owner: int, count: int) -> list[int]:
        if not self._robbed:
            return [self._free.pop() for _ in range(count)]
        # A robbed page goes to a different owner, never back to the one it was taken from
        # while any other page is free: the victim re-taking it would hide the fault, and
        # whether it does would depend on timing.
        stack = self._free[::-1]
        mine = [p for p in stack if self._robbed.get(p) == owner]
        pages = ([p for p in stack if self._robbed.get(p) != owner] + mine)[:count]
        taken = set(pages)
        self._free = [p for p in self._free if p not in taken]
        for page in pages:
            self._robbed.pop(page, None)
        return pages

    def _evict_one(self) -> None:
        page, _ = self._lru.popitem(last=False)
        assert not self.holders.pop(page) and int(self.owner[page]) == SHARED
        del self._by_key[self._key_of.pop(page)]
        self.tags[page] += 1  # whoever remembers (page, old tag) can never read it again
        self.page_tenant[page] = NO_TENANT
        self.owner[page] = FREE
        self.fill[page] = 0
        if self.scrub_on_free:
            self.k[:, page] = 0
            self.v[:, page] = 0
        self._free.append(page)
        self.evictions += 1

    def lookup(self, owner: int, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """The longest run of leading keys that are cached: `owner` takes a reference on each
        page; returns (pages, tags). The key decides the hit; the read check decides the read."""
        assert owner not in (FREE, SHARED)
        with self.lock:
            pages: list[int] = []
            for key in keys:
                page = self._by_key.get(key)
                if page is None:
                    break
                pages.append(page)
            for page in pages:
                assert owner not in self.holders[page], "a request referenced a page twice"
                self.holders[page].add(owner)
                self._lru.pop(page, None)
            return pages, [int(self.tags[p]) for p in pages]

    def publish(
        self, owner: int, pages: list[int], tags: list[int], keys: list[bytes], tenant: int
    ) -> int:
        """Make full pages `owner` wrote shared under `keys`; the owner keeps a reference under
        the same tag. A page not fully written by `owner` under its tag, or whose key is
        already cached (by another request), stays private. Returns how many were published."""
        with self.lock:
            published = 0
            for page, tag, key in zip(pages, tags, keys, strict=True):
                if (
                    key in self._by_key
                    or int(self.owner[page]) != owner
                    or int(self.tags[page]) != tag
                    or int(self.written_tag[page]) != tag
                    or int(self.fill[page]) != self.page_size
                ):
                    continue
                self.owner[page] = SHARED
                self.page_tenant[page] = tenant
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
        with self.lock:
            return self._release(owner, pages, tags)

    def _release(self, owner: int, pages: list[int], tags: list[int]) -> int:
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
                if not self.holders[page]:
                    self._lru[page] = None  # still cached; allocation may evict it
            else:
                freed.append(page)
        if freed:
            idx = torch.tensor(freed)
            if self.scrub_on_free:
                self.k[:, idx] = 0
                self.v[:, idx] = 0
            self.owner[idx] = FREE
            self.fill[idx] = 0
            self._free.extend(freed)
        return int(live.sum())

    def force_release(self, owner: int, pages: list[int]) -> None:
        """Put `owner`'s pages back on the free list while it still uses them (the early-release
        fault). The next allocation by another owner gets them first; `owner` never does while
        any other page is free."""
        with self.lock:
            for page in pages:  # a shared page leaves the cache with it
                if int(self.owner[page]) == SHARED:
                    del self._by_key[self._key_of.pop(page)]
                    self._lru.pop(page, None)
                    self.holders.pop(page, None)
                    self.page_tenant[page] = NO_TENANT
            self.owner[torch.tensor(pages)] = FREE
            self._free.extend(pages)
            self._robbed.update(dict.fromkeys(pages, owner))

    def record_writes(self, slot_pages: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        """After a forward pass wrote these slots, raise each page's fill to cover them."""
        self.fill.scatter_reduce_(0, slot_pages, slot_offsets + 1, reduce="amax")
        self.written_tag[slot_pages] = self.tags[slot_pages]

    def write_page(
        self,
        owner: int,
        page: int,
        tag: int,
        tokens: int,
        payload: memoryview,
        check_tag: bool = True,
    ) -> bool:
        """Write a transferred page (K then V bytes, full page, `tokens` slots valid). The writer
        must present the page's current tag and owner; otherwise nothing is written (False)."""
        k_shape = self.k[:, page].shape
        with self.lock:
            if check_tag and (int(self.owner[page]) != owner or int(self.tags[page]) != tag):
                return False
            flat = torch.frombuffer(payload, dtype=self.k.dtype)
            half = flat.numel() // 2
            self.k[:, page, :tokens] = flat[:half].view(k_shape)[:, :tokens].to(self.k.device)
            self.v[:, page, :tokens] = flat[half:].view(k_shape)[:, :tokens].to(self.v.device)
            self.fill[page] = tokens
            self.written_tag[page] = tag
            return True

    def export(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy pages out as host tensors [pages, layers, page_size, heads, dim]."""
        idx = torch.tensor(pages, device=self.k.device)
        k = self.k.index_select(1, idx).transpose(0, 1).contiguous().cpu()
        v = self.v.index_select(1, idx).transpose(0, 1).contiguous().cpu()
        return k, v
