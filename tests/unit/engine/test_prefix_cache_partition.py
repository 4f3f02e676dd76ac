"""The prefix cache's partition of the pool (core/page_book): whether a tenant's page is still
cached depends on that tenant and the clock, never on another tenant (issue 33, finding 1: a
tenant that primed a shared LRU and probed it read other tenants' prompt lengths)."""

import pytest

from kvfence_engine.core.page_book import SHARED, PageBook
from kvfence_engine.core.pool_plan import cache_partition

PAGE = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def book(clock: Clock, idle_seconds: float = 60.0) -> PageBook:
    # 16 pages: the cache's 8 in two slots of 4, the requests' 8
    return PageBook(16, PAGE, cache_pages=8, cache_tenants=2, cache_idle_seconds=idle_seconds,
                    clock=clock)  # fmt: skip


def cache(b: PageBook, owner: int, tenant: str, keys: list[bytes]) -> list[int]:
    """A request of `tenant` writes full pages under `keys`, publishes them and finishes."""
    pages, tags = b.allocate(owner, len(keys))
    for page, tag in zip(pages, tags, strict=True):
        b.mark_written(page, tag, PAGE)
    b.publish(owner, pages, tags, keys, b.tenant_id(tenant))
    b.release(owner, pages, tags)
    return pages


def cached(b: PageBook, owner: int, keys: list[bytes]) -> int:
    """How many leading pages of `keys` hit (the reference is given back)."""
    pages, tags = b.lookup(owner, keys)
    b.release(owner, pages, tags)
    return len(pages)


def test_an_idle_page_leaves_the_cache_on_the_clock_and_frees_its_slot() -> None:
    clock = Clock()
    b = book(clock)
    cache(b, 1, "acme", [b"a1", b"a2"])
    clock.now = 30.0
    assert cached(b, 2, [b"a1"]) == 1  # used at 30: idle from 30
    clock.now = 61.0
    assert cached(b, 3, [b"a1", b"a2"]) == 1  # a2, idle since 0, is gone; a1 is not
    clock.now = 122.0  # a1 idle since 61
    assert cached(b, 4, [b"a1"]) == 0
    assert b.cache_slots_taken == 0 and b.evictions == 2
    assert b.num_free == 8  # the requests' pages, as always


def test_a_full_slot_table_frees_a_slot_only_when_its_holder_has_no_page_left() -> None:
    clock = Clock()
    b = book(clock)
    cache(b, 1, "acme", [b"a"])
    cache(b, 2, "globex", [b"g"])
    cache(b, 3, "initech", [b"i"])  # no slot
    assert cached(b, 4, [b"i"]) == 0 and b.cache_slots_taken == 2
    clock.now = 61.0  # acme's and globex's pages idle past the deadline
    cache(b, 5, "initech", [b"i"])
    assert cached(b, 6, [b"i"]) == 1 and cached(b, 7, [b"a"]) == 0


@pytest.mark.parametrize("others", [0, 1, 2, 3])
def test_what_a_tenant_keeps_cached_is_independent_of_what_another_tenant_does(
    others: int,
) -> None:
    """Prime-and-probe on the book: globex fills its slot and the requests' pages `others`
    times over; acme's four pages are all still cached, and nothing else of acme's moved."""
    clock = Clock()
    b = book(clock)
    acme = [f"a{i}".encode() for i in range(4)]
    acme_pages = cache(b, 1, "acme", acme)
    tags = b.tags[acme_pages].clone()
    for round_ in range(others):
        held, held_tags = b.allocate(100 + round_, b.num_free)  # every page a request can have
        assert b.num_free == 0
        b.release(100 + round_, held, held_tags)
        cache(b, 200 + round_, "globex", [f"g{round_}-{i}".encode() for i in range(4)])
    assert cached(b, 9, acme) == 4
    assert b.tags[acme_pages].tolist() == tags.tolist()


def test_the_partition_is_refused_when_it_cannot_give_each_slot_a_page() -> None:
    with pytest.raises(ValueError, match="less than one page for each of"):
        cache_partition(16, 0.25, 8, 60.0)
    with pytest.raises(ValueError, match="--prefix-cache-share must be in"):
        cache_partition(16, 1.0, 1, 60.0)
    assert cache_partition(64, 0.25, 8, 60.0).quota == 2


def test_no_allocation_takes_a_page_of_the_partition() -> None:
    b = book(Clock())
    cache(b, 1, "acme", [b"a1", b"a2", b"a3", b"a4"])
    assert b.num_free == 8
    b.allocate(2, 8)
    with pytest.raises(RuntimeError, match="need 1 pages, 0 free"):
        b.allocate(3, 1)
    assert int((b.owner == SHARED).sum()) == 4 and cached(b, 4, [b"a1", b"a2", b"a3", b"a4"]) == 4


def test_the_shared_cache_eviction_fault_lets_another_tenant_evict_a_tenants_pages() -> None:
    """The negative control: with the partition open to allocations, the prime-and-probe
    above reads globex's activity in acme's cache."""
    clock = Clock()
    b = PageBook(16, PAGE, cache_pages=8, cache_tenants=2, clock=clock, shared_eviction=True)
    acme = [b"a1", b"a2"]
    cache(b, 1, "acme", acme)
    clock.now = 1.0
    held, tags = b.allocate(2, b.num_free)  # the free pages and acme's two idle ones
    b.release(2, held, tags)
    assert cached(b, 3, acme) == 0 and b.evictions == 2
