"""The paged KV pool: fixed-size pages, each with a generation tag, a fill count and an owner.

Release never zeroes a page (that is what makes the pool fast and what makes isolation a
bookkeeping problem) unless scrub_on_free is set.
"""

import threading

import torch

FREE = -1


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
        # Allocation, release and transfer writes may come from the engine thread and from
        # transfer receiver threads; the bookkeeping changes under this lock.
        self.lock = threading.RLock()

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

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
        assert owner != FREE
        if count > len(self._free):
            raise PoolExhausted(f"need {count} pages, {len(self._free)} free")
        if count == 0:
            return [], []
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

    def holds(self, owner: int, pages: list[int], tags: list[int]) -> torch.Tensor:
        """Which of these (page, tag) pairs are still live for `owner`."""
        idx = torch.tensor(pages, dtype=torch.int64)
        return (self.owner[idx] == owner) & (self.tags[idx] == torch.tensor(tags))

    def release(self, owner: int, pages: list[int], tags: list[int]) -> int:
        """Return pages to the free list. A (page, tag) the owner no longer holds is left
        alone (someone else owns it now) and counted; returns how many were freed."""
        with self.lock:
            return self._release(owner, pages, tags)

    def _release(self, owner: int, pages: list[int], tags: list[int]) -> int:
        if not pages:
            return 0
        live = self.holds(owner, pages, tags)
        self.stale_releases += int((~live).sum())
        freed = [p for p, ok in zip(pages, live.tolist(), strict=True) if ok]
        if freed:
            idx = torch.tensor(freed)
            if self.scrub_on_free:
                self.k[:, idx] = 0
                self.v[:, idx] = 0
            self.owner[idx] = FREE
            self.fill[idx] = 0
            self._free.extend(freed)
        return len(freed)

    def force_release(self, owner: int, pages: list[int]) -> None:
        """Put `owner`'s pages back on the free list while it still uses them (the early-release
        fault). The next allocation by another owner gets them first; `owner` never does while
        any other page is free."""
        with self.lock:
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
