"""Property tests for the page pool: ownership is exclusive, tags only grow, stale is refused;
shared (prefix-cache) pages are reference-counted, carry their tenant, and are evicted
least-recently-released first with a tag bump."""

from collections import OrderedDict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfence_engine.core.isolation import ReadCheck, check_reads
from kvfence_engine.core.kv_pool import FREE, SHARED, KVPool, PoolExhausted

PAGES = 12


def small_pool(scrub: bool = False) -> KVPool:
    return KVPool(
        num_layers=1,
        num_pages=PAGES,
        page_size=4,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        scrub_on_free=scrub,
    )


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = small_pool()
        self.held: dict[int, list[tuple[int, int]]] = {}  # owner -> [(page, tag)]
        self.history: list[tuple[int, int, int]] = []  # every (owner, page, tag) ever handed out
        self.last_tags = self.pool.tags.clone()
        # the model of the prefix cache: shared page -> (key, tenant id, tag), and the
        # unreferenced ones in the order allocation must evict them
        self.shared: dict[int, tuple[bytes, int, int]] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.keys_made = 0

    def tenant(self, owner: int) -> int:
        return self.pool.tenant_id(f"tenant-{owner % 2}")

    def read_one(self, owner: int, page: int, tag: int, length: int) -> ReadCheck:
        """The read check for one sequence of `owner` reading `length` tokens of one page."""
        return check_reads(
            self.pool.tags,
            self.pool.fill,
            self.pool.written_tag,
            torch.tensor([[page]]),
            torch.tensor([[tag]]),
            torch.tensor([1]),
            torch.tensor([length]),
            4,
            self.pool.page_tenant,
            torch.tensor([self.tenant(owner)]),
        )

    def is_shared(self, page: int) -> bool:
        return page in self.shared

    @rule(owner=st.integers(1, 5), count=st.integers(0, 5))
    def allocate(self, owner: int, count: int) -> None:
        free_before = self.pool.num_free
        evict = max(0, count - (free_before - len(self.lru))) if count <= free_before else 0
        doomed = list(self.lru)[:evict]
        doomed_tags = {p: int(self.pool.tags[p]) for p in doomed}
        try:
            pages, tags = self.pool.allocate(owner, count)
        except PoolExhausted:
            assert count > free_before
            assert self.pool.num_free == free_before  # all or nothing
            return
        for page in doomed:  # evicted, oldest first: out of the cache, tag bumped
            key = self.shared.pop(page)[0]
            del self.lru[page]
            # the eviction retired the tag, then the allocation issued the next one
            assert int(self.pool.tags[page]) == doomed_tags[page] + 2
            assert self.pool.lookup(owner, [key]) == ([], [])
        self.held.setdefault(owner, []).extend(zip(pages, tags, strict=True))
        self.history += [(owner, p, t) for p, t in zip(pages, tags, strict=True)]

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def release_some(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from([o for o, h in self.held.items() if h]))
        held = self.held[owner]
        k = data.draw(st.integers(1, len(held)))
        chunk, self.held[owner] = held[:k], held[k:]
        freed = self.pool.release(owner, [p for p, _ in chunk], [t for _, t in chunk])
        assert freed == len(chunk)
        for page, _ in chunk:
            if self.is_shared(page) and not any(
                page == p for pairs in self.held.values() for p, _ in pairs
            ):
                self.lru[page] = None

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def publish_some(self, data: st.DataObject) -> None:
        """An owner wrote some of its private pages full and publishes them under new keys."""
        owner = data.draw(st.sampled_from([o for o, h in self.held.items() if h]))
        private = [(p, t) for p, t in self.held[owner] if not self.is_shared(p)]
        if not private:
            return
        chosen = data.draw(st.lists(st.sampled_from(private), min_size=1, unique=True))
        pages = [p for p, _ in chosen]
        self.pool.record_writes(
            torch.tensor(pages).repeat_interleave(4), torch.arange(4).repeat(len(pages))
        )
        keys = [self.new_key() for _ in chosen]
        tenant = self.tenant(owner)
        tags = [t for _, t in chosen]
        assert self.pool.publish(owner, pages, tags, keys, tenant) == len(chosen)
        for (page, tag), key in zip(chosen, keys, strict=True):
            self.shared[page] = (key, tenant, tag)
        # publishing a key that is already cached leaves the page private
        if private[len(chosen) :]:
            page, tag = private[len(chosen)]
            if page not in pages:
                assert self.pool.publish(owner, [page], [tag], [keys[0]], tenant) == 0

    def new_key(self) -> bytes:
        self.keys_made += 1
        return self.keys_made.to_bytes(8)

    @precondition(lambda self: bool(self.shared))
    @rule(owner=st.integers(1, 5), data=st.data())
    def look_up(self, owner: int, data: st.DataObject) -> None:
        """Lookup by key takes a reference; the page's tenant is what the read check sees."""
        page = data.draw(st.sampled_from(sorted(self.shared)))
        key, tenant, tag = self.shared[page]
        if (page, tag) in self.held.get(owner, []):
            return  # a request never references one page twice
        assert self.pool.lookup(owner, [key]) == ([page], [tag])
        self.lru.pop(page, None)
        self.held.setdefault(owner, []).append((page, tag))
        self.history.append((owner, page, tag))
        check = self.read_one(owner, page, tag, length=4)
        assert not bool(check.tag_mismatch[0]) and not bool(check.unwritten[0])
        assert bool(check.foreign[0]) == (tenant != self.tenant(owner))

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data())
    def stale_pairs_are_refused(self, data: st.DataObject) -> None:
        owner, page, tag = data.draw(st.sampled_from(self.history))
        if (page, tag) in self.held.get(owner, []):
            return  # still live: not stale
        owner_before = int(self.pool.owner[page])
        holders_before = set(self.pool.holders.get(page, ()))
        assert self.pool.release(owner, [page], [tag]) == 0
        assert int(self.pool.owner[page]) == owner_before
        assert self.pool.holders.get(page, set()) == holders_before
        check = self.read_one(owner, page, tag, length=1)
        cached = self.shared.get(page)
        if cached is not None and cached[2] == tag:
            # Still cached under the tag it had: read-only bytes that never change under that
            # tag, so only the tenant decides (eviction bumps the tag and ends this).
            assert bool(check.failed[0]) == (cached[1] != self.tenant(owner))
            return
        assert bool(check.failed[0]), "a stale (page, tag) must never pass the read check"

    @invariant()
    def no_page_has_two_live_owners(self) -> None:
        seen: dict[int, int] = {}
        readers: dict[int, set[int]] = {page: set() for page in self.shared}
        for owner, pairs in self.held.items():
            for page, tag in pairs:
                assert int(self.pool.tags[page]) == tag
                if self.is_shared(page):
                    assert owner not in readers[page]
                    readers[page].add(owner)
                    continue
                assert page not in seen, f"page {page} held by {seen.get(page)} and {owner}"
                seen[page] = owner
                assert int(self.pool.owner[page]) == owner
        free = self.pool._free
        assert len(free) == len(set(free)), "a page is on the free list twice"
        assert not set(free) & seen.keys(), "a held page is on the free list"
        assert not set(free) & self.shared.keys(), "a cached page is on the free list"
        assert all(int(self.pool.owner[p]) == FREE for p in free)
        assert len(free) + len(seen) + len(self.shared) == PAGES

    @invariant()
    def shared_pages_are_counted_and_carry_their_tenant(self) -> None:
        for page, (_key, tenant, tag) in self.shared.items():
            holders = {o for o, pairs in self.held.items() if (page, tag) in pairs}
            assert int(self.pool.owner[page]) == SHARED
            assert self.pool.holders[page] == holders
            assert int(self.pool.page_tenant[page]) == tenant
            assert int(self.pool.tags[page]) == tag
            assert (page in self.lru) == (not holders)
        assert list(self.pool._lru) == list(self.lru)  # eviction order: least recently released
        assert self.pool.num_free == len(self.pool._free) + len(self.lru)
        assert bool((self.pool.page_tenant[self.pool.owner != SHARED] == -1).all())

    @invariant()
    def tags_only_grow(self) -> None:
        assert bool((self.pool.tags >= self.last_tags).all())
        self.last_tags = self.pool.tags.clone()


TestPoolStateMachine = PoolMachine.TestCase
TestPoolStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(1, 3), min_size=1, max_size=6))
@settings(deadline=None, max_examples=50)
def test_scrub_on_free_zeroes_released_pages_and_nothing_else(counts: list[int]) -> None:
    pool = small_pool(scrub=True)
    pool.k.fill_(7.0)
    pool.v.fill_(7.0)
    grants = [pool.allocate(i + 1, c) for i, c in enumerate(counts) if c <= pool.num_free]
    pages, tags = grants[0]
    pool.release(1, pages, tags)
    others = [p for g in grants[1:] for p in g[0]]
    assert bool((pool.k[:, pages] == 0).all()) and bool((pool.v[:, pages] == 0).all())
    if others:
        assert bool((pool.k[:, others] == 7.0).all())


def test_release_without_scrub_leaves_the_old_bytes_in_place() -> None:
    # Documenting the threat: a freed page still holds its previous owner's KV.
    pool = small_pool()
    pages, tags = pool.allocate(1, 1)
    pool.k[:, pages] = 3.0
    pool.release(1, pages, tags)
    again, _ = pool.allocate(2, 1)
    assert again == pages
    assert bool((pool.k[:, again] == 3.0).all())
