"""Property tests for the page pool: ownership is exclusive, tags only grow, stale is refused."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfence_engine.core.isolation import check_reads
from kvfence_engine.core.kv_pool import FREE, KVPool, PoolExhausted

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

    @rule(owner=st.integers(1, 5), count=st.integers(0, 5))
    def allocate(self, owner: int, count: int) -> None:
        free_before = self.pool.num_free
        try:
            pages, tags = self.pool.allocate(owner, count)
        except PoolExhausted:
            assert count > free_before
            assert self.pool.num_free == free_before  # all or nothing
            return
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

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data())
    def stale_pairs_are_refused(self, data: st.DataObject) -> None:
        owner, page, tag = data.draw(st.sampled_from(self.history))
        if (page, tag) in self.held.get(owner, []):
            return  # still live: not stale
        owner_before = int(self.pool.owner[page])
        assert self.pool.release(owner, [page], [tag]) == 0
        assert int(self.pool.owner[page]) == owner_before
        check = check_reads(
            self.pool.tags,
            self.pool.fill,
            self.pool.written_tag,
            torch.tensor([[page]]),
            torch.tensor([[tag]]),
            torch.tensor([1]),
            torch.tensor([1]),
            4,
        )
        assert bool(check.failed[0]), "a stale (page, tag) must never pass the read check"

    @invariant()
    def no_page_has_two_live_owners(self) -> None:
        seen: dict[int, int] = {}
        for owner, pairs in self.held.items():
            for page, tag in pairs:
                assert page not in seen, f"page {page} held by {seen.get(page)} and {owner}"
                seen[page] = owner
                assert int(self.pool.owner[page]) == owner
                assert int(self.pool.tags[page]) == tag
        free = self.pool._free
        assert len(free) == len(set(free)), "a page is on the free list twice"
        assert not set(free) & seen.keys(), "a held page is on the free list"
        assert all(int(self.pool.owner[p]) == FREE for p in free)
        assert len(free) + len(seen) == PAGES

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
