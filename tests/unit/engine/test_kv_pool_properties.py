"""Property tests for the page pool, driven through the page table's owner (PageManager) the
way the scheduler and the engine drive it: requests allocate (their cached prefix included),
grow, publish and deallocate. Ownership is exclusive, tags only grow, a stale (page, tag) is
refused for release and for a transfer write; shared (prefix-cache) pages are
reference-counted, carry their tenant, live in the cache's own partition (no allocation takes
one, whatever the cache holds), and are evicted only by their own tenant's publishing past its
quota, least-recently-released first, with a tag bump."""

import itertools
from collections import OrderedDict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfence_engine.core.isolation import ReadCheck, check_reads
from kvfence_engine.core.kv_cache import KVCache
from kvfence_engine.core.page_book import FREE, NO_TENANT, SHARED
from kvfence_engine.core.page_manager import PageManager
from kvfence_engine.core.pool_plan import CachePartition
from kvfence_engine.core.request import Request, SamplingParams

PAGES = 12
PAGE = 4
CACHE = CachePartition(pages=4, tenants=2)  # two slots of 2 pages; the requests' 8 pages
TENANTS = 3  # one more than the slots
KEYS = [bytes([i]) * 8 for i in range(10)]  # the prompt pages the machine's requests share


def small_pool(scrub: bool = False) -> PageManager:
    kv = KVCache(
        num_layers=1,
        num_pages=PAGES,
        page_size=PAGE,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return PageManager(kv, scrub_on_free=scrub, cache=CACHE)


def request(seq_id: int, tokens: int, keys: list[bytes] | None = None) -> Request:
    seq = Request(seq_id, [7] * tokens, SamplingParams(max_tokens=1), tenant=f"t{seq_id % TENANTS}")
    seq.cache_keys = keys or []
    return seq


def page_bytes(value: float) -> memoryview:
    """A transferred page's payload: K then V, a whole page of `value`."""
    return memoryview(bytearray(torch.full((2 * PAGE * 2,), value).numpy().tobytes()))


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pages = small_pool()
        self.book = self.pages.book
        self.live: dict[int, Request] = {}  # requests holding pages
        self.ids = itertools.count(1)
        self.history: list[tuple[int, int, int]] = []  # every (owner, page, tag) ever handed out
        self.last_tags = self.book.tags.clone()
        # the model of the prefix cache: shared page -> (key, tenant id, tag), and each
        # tenant's unreferenced ones in the order its own publishing must evict them
        self.shared: dict[int, tuple[bytes, int, int]] = {}
        self.idle: dict[int, OrderedDict[int, None]] = {}

    def read_one(self, seq: Request, page: int, tag: int, length: int) -> ReadCheck:
        """The read check for `seq` reading `length` tokens of one page under `tag`."""
        return check_reads(
            self.book.tags,
            self.book.fill,
            self.book.written_tag,
            torch.tensor([[page]]),
            torch.tensor([[tag]]),
            torch.tensor([1]),
            torch.tensor([length]),
            PAGE,
            self.book.page_tenant,
            torch.tensor([self.pages.tenant_id(seq.tenant)]),
        )

    def holders(self, page: int) -> set[int]:
        return {s.seq_id for s in self.live.values() if page in s.pages}

    def key_page(self, key: bytes) -> int | None:
        return next((p for p, (k, _t, _g) in self.shared.items() if k == key), None)

    def cached_by(self, tenant: int) -> list[int]:
        return [p for p, (_k, t, _g) in self.shared.items() if t == tenant]

    def idle_of(self, page: int) -> OrderedDict[int, None]:
        return self.idle.setdefault(self.shared[page][1], OrderedDict())

    def evict(self, tenant: int) -> None:
        """The tenant's own least recently released page leaves the cache, its tag retired."""
        page, _ = self.idle[tenant].popitem(last=False)
        key, owner, tag = self.shared.pop(page)
        assert owner == tenant, "a tenant's publishing evicted another tenant's page"
        assert int(self.book.tags[page]) == tag + 1 and int(self.book.owner[page]) == FREE
        assert self.key_page(key) is None

    @rule(
        tokens=st.integers(1, 20),
        keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=5),
        publish=st.booleans(),
    )
    def prefill(self, tokens: int, keys: list[bytes], publish: bool) -> None:
        """A prefill allocates all its tokens' pages, its cached prefix first, or nothing; it
        writes what it computes and may publish its full pages."""
        keys = keys[: tokens // PAGE]  # a key per full page of the prompt
        seq = request(next(self.ids), tokens, keys)
        usable = keys[: (tokens - 1) // PAGE]  # at least one token is left to compute
        hits: list[int] = []  # the cached pages of the prompt's leading keys, up to a miss
        for key in usable:
            if (hit := self.key_page(key)) is None:
                break
            hits.append(hit)
        free_before = self.pages.num_free  # the cache's pages are never among them
        needed = -(-tokens // PAGE) - len(hits)
        if not self.pages.allocate(seq):
            assert needed > free_before
            assert self.pages.num_free == free_before and seq.pages == []  # all or nothing
            for page in hits:  # its lookup used them: most recently released now
                if page in self.idle_of(page):
                    self.idle_of(page).move_to_end(page)
            return
        assert needed <= free_before and self.pages.num_free == free_before - needed
        for page in hits:  # referenced: not idle
            self.idle_of(page).pop(page, None)
        assert seq.pages[: len(hits)] == hits and len(seq.pages) == -(-tokens // PAGE)
        assert seq.prefill_start == len(hits) * PAGE
        self.live[seq.seq_id] = seq
        self.history += [(seq.seq_id, p, t) for p, t in zip(seq.pages, seq.page_tags, strict=True)]
        for page, tag in zip(hits, seq.page_tags, strict=False):
            assert tag == self.shared[page][2]
            check = self.read_one(seq, page, tag, PAGE)
            assert not bool(check.tag_mismatch[0]) and not bool(check.unwritten[0])
            assert bool(check.foreign[0]) == (self.shared[page][1] != self.tenant(seq))
        positions = torch.arange(seq.prefill_start, tokens)
        self.pages.record_writes(
            torch.tensor(seq.pages)[positions // PAGE].contiguous(), positions % PAGE
        )
        if publish:
            self.publish(seq)

    def tenant(self, seq: Request) -> int:
        return self.pages.tenant_id(seq.tenant)

    def publish(self, seq: Request) -> None:
        """The prefill's full pages past its cached ones become shared, unless their key is
        cached already (another page holds it); past its quota the tenant's own least recently
        released page makes room, and with none idle, or no free slot, the rest stay private."""
        first, full = seq.prefill_start // PAGE, len(seq.cache_keys)
        pages, tags, keys = seq.pages[first:full], seq.page_tags[first:full], seq.cache_keys[first:]
        tenant = self.tenant(seq)
        expected: list[tuple[int, bytes, int]] = []
        evictions: list[int] = []  # the tenant's pages the book must evict, in order
        cached = len(self.cached_by(tenant))
        idle = list(self.idle.get(tenant, {}))
        slots = {t for _k, t, _g in self.shared.values()}
        for page, tag, key in zip(pages, tags, keys, strict=True):
            holder = self.key_page(key)
            if holder is not None and holder not in evictions:
                continue  # cached already (a key this pass evicted is free to publish again)
            if tenant in slots and cached >= CACHE.quota:
                if not idle:
                    break  # all its cached pages are in use
                evictions.append(idle.pop(0))
                cached -= 1
                if not cached:
                    slots.discard(tenant)  # its last page: the slot is given back
            if tenant not in slots:
                if len(slots) >= CACHE.tenants:
                    break  # no free slot
                slots.add(tenant)
            expected.append((page, key, tag))
            cached += 1
        assert self.pages.publish(seq) == len(expected)
        for _ in evictions:
            self.evict(tenant)
        for page, key, tag in expected:
            self.shared[page] = (key, tenant, tag)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """A decode step writes one more position; it may need a page, which it gets only if
        one is free (else the scheduler preempts, and the table is unchanged)."""
        seq = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda s: s.seq_id)))
        seq.output_ids.append(7)
        needs_page = len(seq.pages) < -(-seq.num_tokens // PAGE)
        assert self.pages.can_append(seq) == (not needs_page or self.pages.num_free > 0)
        if not self.pages.can_append(seq):
            seq.output_ids.pop()
            return
        before = list(seq.pages)
        self.pages.may_append(seq)
        assert seq.pages[: len(before)] == before
        assert len(seq.pages) == len(before) + needs_page
        if needs_page:
            self.history.append((seq.seq_id, seq.pages[-1], seq.page_tags[-1]))
        position = torch.tensor([seq.num_tokens - 1])
        self.pages.record_writes(torch.tensor([seq.pages[-1]]), position % PAGE)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def deallocate(self, data: st.DataObject) -> None:
        """A finished (or preempted) request gives every page back: its private pages to the
        free list, its references on shared ones, which go idle at none."""
        seq = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda s: s.seq_id)))
        held = list(seq.pages)
        del self.live[seq.seq_id]
        assert self.pages.deallocate(seq) == len(held)
        assert (seq.pages, seq.page_tags, seq.prefill_start, seq.num_cached) == ([], [], 0, 0)
        for page in held:
            if page in self.shared and not self.holders(page):
                self.idle_of(page)[page] = None
        assert self.pages.take_stale_releases() == 0

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data())
    def stale_pairs_are_refused(self, data: st.DataObject) -> None:
        """A request presenting a (page, tag) it no longer holds releases nothing, writes
        nothing, is counted, and never passes the read check."""
        owner, page, tag = data.draw(st.sampled_from(self.history))
        live = self.live.get(owner)
        if live is not None and (page, tag) in zip(live.pages, live.page_tags, strict=True):
            return  # still live: not stale
        stale = request(owner, PAGE)
        stale.pages, stale.page_tags = [page], [tag]
        before = [t[page].clone() for t in (self.book.owner, self.book.fill, self.book.written_tag)]
        holders_before = set(self.book.holders.get(page, ()))
        assert not self.pages.write_transferred(stale, page, tag, PAGE, page_bytes(9.0))
        assert self.pages.deallocate(stale) == 0
        assert self.pages.take_stale_releases() == 1
        after = [t[page] for t in (self.book.owner, self.book.fill, self.book.written_tag)]
        assert all(bool(a == b) for a, b in zip(after, before, strict=True))
        assert self.book.holders.get(page, set()) == holders_before
        assert not bool((self.pages.kv.k[:, page] == 9.0).any())
        check = self.read_one(stale, page, tag, length=1)
        cached = self.shared.get(page)
        if cached is not None and cached[2] == tag:
            # Still cached under the tag it had: read-only bytes that never change under that
            # tag, so only the tenant decides (eviction bumps the tag and ends this).
            assert bool(check.failed[0]) == (cached[1] != self.tenant(stale))
            return
        assert bool(check.failed[0]), "a stale (page, tag) must never pass the read check"

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def transfer_write(self, data: st.DataObject) -> None:
        """A transfer write into a page the request holds privately lands and counts as
        written under its tag; one into a shared page it only references does not."""
        seq = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda s: s.seq_id)))
        i = data.draw(st.integers(0, len(seq.pages) - 1))
        page, tag = seq.pages[i], seq.page_tags[i]
        tokens = data.draw(st.integers(1, PAGE))
        written = self.pages.write_transferred(seq, page, tag, tokens, page_bytes(float(tokens)))
        assert written == (page not in self.shared)
        if written:
            assert int(self.book.fill[page]) == tokens and int(self.book.written_tag[page]) == tag
            assert bool((self.pages.kv.k[:, page, :tokens] == float(tokens)).all())
            assert not bool(self.read_one(seq, page, tag, tokens).failed[0])

    @invariant()
    def no_page_has_two_live_owners(self) -> None:
        seen: dict[int, int] = {}
        for seq in self.live.values():
            assert len(seq.pages) == len(seq.page_tags) == -(-seq.num_tokens // PAGE)
            assert len(set(seq.pages)) == len(seq.pages), "a request holds a page twice"
            for page, tag in zip(seq.pages, seq.page_tags, strict=True):
                assert int(self.book.tags[page]) == tag
                if page in self.shared:
                    assert seq.seq_id in self.book.holders[page]
                    continue
                assert page not in seen, f"page {page} held by {seen.get(page)} and {seq.seq_id}"
                seen[page] = seq.seq_id
                assert int(self.book.owner[page]) == seq.seq_id
        free = self.book._free
        assert len(free) == len(set(free)), "a page is on the free list twice"
        assert not set(free) & seen.keys(), "a held page is on the free list"
        assert not set(free) & self.shared.keys(), "a cached page is on the free list"
        assert all(int(self.book.owner[p]) == FREE for p in free)
        assert len(free) + len(seen) + len(self.shared) == PAGES
        # the requests' pages are the pool less the cache's partition, whatever it holds
        assert self.pages.num_free == PAGES - CACHE.pages - len(seen)

    @invariant()
    def shared_pages_are_counted_and_carry_their_tenant(self) -> None:
        for page, (_key, tenant, tag) in self.shared.items():
            holders = self.holders(page)
            assert int(self.book.owner[page]) == SHARED
            assert self.book.holders[page] == holders
            assert int(self.book.page_tenant[page]) == tenant
            assert int(self.book.tags[page]) == tag
            assert (page in self.idle_of(page)) == (not holders)
        caches = self.book._caches
        tenants = {t for _k, t, _g in self.shared.values()}
        assert caches.keys() == tenants and len(tenants) <= CACHE.tenants  # a slot each
        for tenant, cache in caches.items():
            assert cache.pages == len(self.cached_by(tenant)) <= CACHE.quota
            assert list(cache.idle) == list(self.idle[tenant])  # least recently released first
        assert self.pages.num_cached == len(self.shared)
        assert bool((self.book.page_tenant[self.book.owner != SHARED] == NO_TENANT).all())

    @invariant()
    def tags_only_grow(self) -> None:
        assert bool((self.book.tags >= self.last_tags).all())
        self.last_tags = self.book.tags.clone()


TestPoolStateMachine = PoolMachine.TestCase
TestPoolStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(1, 3), min_size=1, max_size=6))
@settings(deadline=None, max_examples=50)
def test_scrub_on_free_zeroes_released_pages_and_nothing_else(counts: list[int]) -> None:
    pool = small_pool(scrub=True)
    pool.kv.k.fill_(7.0)
    pool.kv.v.fill_(7.0)
    seqs = [request(i + 1, c * PAGE) for i, c in enumerate(counts)]
    granted = [seq for seq in seqs if pool.allocate(seq)]
    pages = list(granted[0].pages)
    pool.deallocate(granted[0])
    others = [p for seq in granted[1:] for p in seq.pages]
    assert bool((pool.kv.k[:, pages] == 0).all()) and bool((pool.kv.v[:, pages] == 0).all())
    if others:
        assert bool((pool.kv.k[:, others] == 7.0).all())


def test_release_without_scrub_leaves_the_old_bytes_in_place() -> None:
    # Documenting the threat: a freed page still holds its previous owner's KV.
    pool = small_pool()
    first, second = request(1, PAGE), request(2, PAGE)
    assert pool.allocate(first)
    pages = list(first.pages)
    pool.kv.k[:, pages] = 3.0
    pool.deallocate(first)
    assert pool.allocate(second)
    assert second.pages == pages
    assert bool((pool.kv.k[:, second.pages] == 3.0).all())
