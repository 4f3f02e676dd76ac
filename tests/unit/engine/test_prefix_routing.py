"""Prefix-aware prefill placement (issue 17): a pure choice by rendezvous hashing of a keyed
(tenant, first tokens) key with bounded loads; the pool's use of it."""

import random
import time
from collections import Counter
from pathlib import Path

import pytest

from kvfence_engine.contracts import Role
from kvfence_engine.core.errors import EngineError
from kvfence_engine.router.backends import Backend, BackendPool
from kvfence_engine.router.placement import Candidate, PrefixRouting, load_bound

SECRET = b"s" * 32
URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]


def idle(urls: list[str] = URLS) -> list[Candidate]:
    return [Candidate(u, 0) for u in urls]


def prompts(n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    return [
        (f"tenant-{rng.randrange(8)}", [rng.randrange(50_000) for _ in range(80)]) for _ in range(n)
    ]


def test_the_same_tenant_and_prefix_go_to_the_same_instance() -> None:
    routing = PrefixRouting(SECRET)
    prompt = list(range(100, 180))
    first = routing.choose("acme", prompt, idle())
    # Later turns of the conversation share the first 64 tokens and differ after them.
    for tail in ([], [1, 2, 3], list(range(500))):
        assert routing.choose("acme", prompt[:64] + tail, idle()) == first
    # A fresh router process with the same secret agrees (every replica places alike).
    assert PrefixRouting(SECRET).choose("acme", prompt, idle()) == first


def test_the_tenant_and_the_first_tokens_are_in_the_key() -> None:
    routing = PrefixRouting(SECRET)
    prompt = list(range(80))
    key = routing.key("acme", prompt)
    assert routing.key("other", prompt) != key
    assert routing.key("acme", [7, *prompt[1:]]) != key
    assert routing.key("acme", prompt[:64] + [9] * 16) == key  # past the first 64: same key
    # Length-prefixed: a tenant name cannot absorb tokens and collide.
    assert routing.key("a", [1]) != routing.key("a\x00", [1])


def test_placement_depends_on_the_secret() -> None:
    """Without the secret nobody can say where a prompt lands: a different secret gives an
    unrelated placement (about 1 in 5 agree by chance with 5 instances)."""
    requests = prompts(400)
    a, b = PrefixRouting(SECRET), PrefixRouting(b"t" * 32)
    same = sum(a.choose(t, p, idle()) == b.choose(t, p, idle()) for t, p in requests)
    assert 40 < same < 120, same
    # and each spreads keys over every instance
    for routing in (a, b):
        counts = Counter(routing.choose(t, p, idle()) for t, p in requests)
        assert set(counts) == set(URLS)
        assert min(counts.values()) > 40, counts


def test_removing_an_instance_moves_only_its_keys() -> None:
    routing = PrefixRouting(SECRET)
    requests = prompts(400, seed=1)
    before = [routing.choose(t, p, idle()) for t, p in requests]
    gone = URLS[2]
    after = [routing.choose(t, p, idle([u for u in URLS if u != gone])) for t, p in requests]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved, "the removed instance had keys"
    assert all(b == gone for b, _ in moved)
    assert all(a != gone for a in after)
    # Adding it back restores the original placement exactly.
    assert [routing.choose(t, p, idle()) for t, p in requests] == before


def test_a_down_instance_is_passed_over_for_the_keys_next_choice() -> None:
    routing = PrefixRouting(SECRET)
    prompt = list(range(64))
    ranking = routing.ranking(routing.key("acme", prompt), URLS)
    down = [Candidate(u, 0, alive=u != ranking[0]) for u in URLS]
    assert routing.choose("acme", prompt, down) == ranking[1]
    with pytest.raises(ValueError, match="no live instance"):
        routing.choose("acme", prompt, [Candidate(u, 0, alive=False) for u in URLS])


def test_an_overloaded_instance_is_passed_over_within_the_bound() -> None:
    routing = PrefixRouting(SECRET)
    prompt = list(range(64))
    ranking = routing.ranking(routing.key("acme", prompt), URLS)
    # 20 outstanding on the first choice, none elsewhere: bound ceil(1.25 * 21 / 5) = 6.
    assert load_bound(20, 5) == 6
    loads = [Candidate(u, 20 if u == ranking[0] else 0) for u in URLS]
    assert routing.choose("acme", prompt, loads) == ranking[1]
    # Under the bound it keeps the key's instance even though others are idler; at low load
    # the bound is MIN_LOAD_BOUND (4), not ceil(1.25 * 4 / 5) = 1.
    assert load_bound(3, 5) == 4
    loads = [Candidate(u, 3 if u == ranking[0] else 0) for u in URLS]
    assert routing.choose("acme", prompt, loads) == ranking[0]
    loads = [Candidate(u, 4 if u == ranking[0] else 0) for u in URLS]
    assert routing.choose("acme", prompt, loads) == ranking[1]


def test_a_hot_prefix_never_piles_past_the_bound() -> None:
    """One tenant sending one prompt many times at once: every instance's load stays within
    the bound computed when it was chosen."""
    routing = PrefixRouting(SECRET)
    prompt = list(range(64))
    load = dict.fromkeys(URLS, 0)
    for _ in range(50):
        total = sum(load.values())
        url = routing.choose("hot", prompt, [Candidate(u, n) for u, n in load.items()])
        assert load[url] < load_bound(total, len(URLS))
        load[url] += 1
    assert max(load.values()) <= load_bound(49, len(URLS)) == 13, load
    assert sum(1 for n in load.values() if n) >= 4, load  # spilled over in rank order


def test_a_short_secret_or_prefix_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        PrefixRouting(b"short")
    with pytest.raises(ValueError, match="at least 1"):
        PrefixRouting(SECRET, 0)
    path = tmp_path / "routing-secret"
    path.write_bytes(b"tiny\n")
    with pytest.raises(ValueError, match=f"{path}: the routing secret must be at least 16"):
        PrefixRouting.from_file(path)
    path.write_bytes(SECRET + b"\n")
    assert PrefixRouting.from_file(path).key("t", [1]) == PrefixRouting(SECRET).key("t", [1])


def test_the_pool_routes_by_prefix_and_skips_down_instances() -> None:
    routing = PrefixRouting(SECRET)
    pool = BackendPool(Role.PREFILL, [Backend(u) for u in URLS])
    prompt = list(range(64))
    ranking = routing.ranking(routing.key("acme", prompt), URLS)
    assert pool.pick_by_prefix(routing, "acme", prompt).url == ranking[0]
    pool.mark_down(next(b for b in pool.backends if b.url == ranking[0]))
    assert pool.pick_by_prefix(routing, "acme", prompt).url == ranking[1]
    for b in pool.backends:
        b.down_until = time.monotonic() + 60
    with pytest.raises(EngineError) as caught:
        pool.pick_by_prefix(routing, "acme", prompt)
    assert (caught.value.status, caught.value.code) == (503, "overloaded")
