"""The tenant-scoped prefix cache in one engine: full prompt pages are reused within a tenant
(and a client salt), never across tenants; a hit changes no output; a tenant's pages are
evicted only by its own publishing (past its quota), with a tag bump; and the read check
refuses a shared page of another tenant."""

import torch

from helpers.engines import TinyEngineOptions, make_tiny_engine, prompt_of, run_until_done
from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.isolation import check_reads
from kvfence_engine.core.page_book import NO_TENANT, SHARED
from kvfence_engine.core.prefix_cache import PrefixKeys
from kvfence_engine.core.request import Request, SamplingParams, is_terminal

PAGE = 16
# 64 pages: the cache's 16 in two slots of 8 pages, the requests' 48
CACHE = TinyEngineOptions(prefix_cache=True, prefix_cache_tenants=2)


def ask(
    engine: LLMEngine,
    prompt: list[int],
    tenant: str = "acme",
    salt: str | None = None,
    max_tokens: int = 8,
    run: bool = True,
) -> Request:
    params = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=0)
    seq = engine.admit(prompt, params, max_tokens=max_tokens, tenant=tenant, cache_salt=salt)
    assert not is_terminal(seq), seq.error
    engine.add(seq)
    if run:
        run_until_done(engine)
    return seq


def counter(engine: LLMEngine, name: str) -> float:
    value = engine.metrics.registry.get_sample_value(name + "_total")
    assert value is not None, name
    return value


def logprobs(seq: Request) -> torch.Tensor:
    return torch.tensor([x.logprob for x in seq.output_logprobs])


def test_a_repeated_prompt_of_the_same_tenant_reuses_its_full_pages() -> None:
    engine = make_tiny_engine(**CACHE)
    prompt = prompt_of(50, seed=1)  # 3 full pages and a partial one
    first, again = ask(engine, prompt), ask(engine, prompt)
    assert first.cached_tokens == 0 and again.cached_tokens == 3 * PAGE
    assert counter(engine, "kvfence_prefix_cache_hit_tokens") == 3 * PAGE
    assert counter(engine, "kvfence_prefix_cache_queried_tokens") == 2 * 50
    assert engine.kvpool_report().prefix_cache and engine.kvpool_report().cached_pages == 3
    # the cached pages are the cache's partition's: the requests' pages are all free again
    assert engine.pages.num_free == engine.pages.num_pages == 48
    assert engine.kvpool_report().prefix_cache_pages == 16


def test_the_same_prompt_of_another_tenant_never_hits() -> None:
    engine = make_tiny_engine(**CACHE)
    prompt = prompt_of(50, seed=1)
    ask(engine, prompt, tenant="acme")
    other = ask(engine, prompt, tenant="globex")
    assert other.cached_tokens == 0
    assert counter(engine, "kvfence_prefix_cache_hit_tokens") == 0
    assert engine.pages.num_cached == 6  # each tenant its own copy


def test_a_client_salt_only_narrows_sharing_within_the_tenant() -> None:
    engine = make_tiny_engine(prefix_cache=True, prefix_cache_tenants=1)  # all salts in 16
    prompt = prompt_of(50, seed=1)
    ask(engine, prompt, salt="alice")
    assert ask(engine, prompt, salt="bob").cached_tokens == 0
    assert ask(engine, prompt).cached_tokens == 0  # no salt is not the empty salt
    assert ask(engine, prompt, salt="alice").cached_tokens == 3 * PAGE
    # the same salt under another tenant is still another tenant
    assert ask(engine, prompt, tenant="globex", salt="alice").cached_tokens == 0


def test_a_hit_changes_no_token_and_no_logprob() -> None:
    cached, cold = make_tiny_engine(**CACHE), make_tiny_engine()
    prompt = prompt_of(70, seed=3)
    ask(cached, prompt[:40] + prompt_of(30, seed=4))  # shares the first 2 pages only
    hit = ask(cached, prompt, max_tokens=24)
    ref = ask(cold, prompt, max_tokens=24)
    assert hit.cached_tokens == 2 * PAGE
    assert hit.output_ids == ref.output_ids
    assert torch.allclose(logprobs(hit), logprobs(ref), atol=1e-4)


def test_a_prompt_of_whole_pages_still_computes_its_last_token() -> None:
    engine, cold = make_tiny_engine(**CACHE), make_tiny_engine()
    prompt = prompt_of(4 * PAGE, seed=5)
    ask(engine, prompt)
    hit = ask(engine, prompt, max_tokens=12)
    assert hit.cached_tokens == 3 * PAGE  # the last page is recomputed: its token has logits
    assert hit.output_ids == ask(cold, prompt, max_tokens=12).output_ids


def test_a_partial_page_is_never_shared() -> None:
    engine = make_tiny_engine(**CACHE)
    prompt = prompt_of(40, seed=6)  # 2 full pages, 8 tokens on a third
    ask(engine, prompt)
    assert engine.pages.num_cached == 2
    longer = ask(engine, prompt + prompt_of(20, seed=7))
    assert longer.cached_tokens == 2 * PAGE  # not the 8 tokens of the partial page


def test_requests_in_flight_share_pages_by_reference_and_release_them() -> None:
    engine = make_tiny_engine(**CACHE)
    prompt = prompt_of(50, seed=8)
    ask(engine, prompt)
    a = ask(engine, prompt, max_tokens=30, run=False)
    b = ask(engine, prompt, max_tokens=30, run=False)
    engine.step()  # both prefilled, both hold the same three shared pages
    assert a.pages[:3] == b.pages[:3]
    for page in a.pages[:3]:
        assert int(engine.pages.book.owner[page]) == SHARED
        assert engine.pages.book.holders[page] == {a.seq_id, b.seq_id}
    assert a.pages[3] != b.pages[3]  # the partial page is each one's own
    run_until_done(engine)
    assert a.error is None and b.error is None and a.output_ids == b.output_ids
    holders = engine.pages.book.holders
    assert all(not holders[p] for p in a.pages[:3] if p in holders)
    assert engine.pages.num_free == engine.pages.num_pages


def test_eviction_bumps_the_tag_so_a_remembered_page_can_never_be_read() -> None:
    # 16 pages: the cache's 4 in one slot, the requests' 12
    engine = make_tiny_engine(pages=16, prefix_cache=True, prefix_cache_tenants=1)
    first = ask(engine, prompt_of(65, seed=9), max_tokens=1)  # publishes 4 pages
    book = engine.pages.book
    cached = [p for p in range(16) if int(book.owner[p]) == SHARED]
    assert len(cached) == 4 and first.pages == [] and engine.pages.num_free == 12
    tags_before = book.tags[cached].clone()
    # the same tenant's next prompt, 4 other full pages: past the quota, its own oldest go
    ask(engine, prompt_of(65, seed=10), max_tokens=1)
    assert book.evictions == 4
    assert book.tags[cached].tolist() == (tags_before + 1).tolist()  # each tag retired
    # whoever remembered (page, old tag) fails the read check
    check = check_reads(
        book.tags,
        book.fill,
        book.written_tag,
        torch.tensor([cached]),
        tags_before[None, :],
        torch.tensor([4]),
        torch.tensor([4 * PAGE]),
        PAGE,
    )
    assert check.tag_mismatch.tolist() == [True]
    # and the old prompt no longer hits what is gone
    assert ask(engine, prompt_of(65, seed=9), max_tokens=1).cached_tokens == 0


def test_another_tenants_requests_never_evict_a_tenants_cached_pages() -> None:
    """The eviction channel (issue 33, finding 1): whatever globex sends, however much of the
    pool it fills and however much it publishes, acme's cached pages stay cached."""
    engine = make_tiny_engine(**CACHE)
    acme = prompt_of(65, seed=40)  # 4 full pages
    ask(engine, acme, tenant="acme", max_tokens=1)
    for i in range(6):  # 25 full pages each, far past globex's quota of 8
        ask(engine, prompt_of(400, seed=41 + i), tenant="globex", max_tokens=1)
    assert engine.pages.book.evictions > 0  # globex's own
    assert ask(engine, acme, tenant="acme", max_tokens=1).cached_tokens == 4 * PAGE


def test_a_tenant_without_a_free_slot_publishes_nothing_and_reads_no_one_elses_pages() -> None:
    engine = make_tiny_engine(**CACHE)  # two slots
    for tenant in ("acme", "globex"):
        ask(engine, prompt_of(50, seed=42), tenant=tenant)
    late = prompt_of(50, seed=43)
    ask(engine, late, tenant="initech")
    assert ask(engine, late, tenant="initech").cached_tokens == 0  # no slot: cached nothing
    assert engine.pages.book.cache_slots_taken == 2 and engine.pages.book.evictions == 0


def test_keys_are_keyed_chained_and_scoped() -> None:
    keys = PrefixKeys(b"s" * 32, 4)
    tokens = list(range(10))
    a = keys.page_keys("acme", None, tokens)
    assert len(a) == 2  # two full pages; the 2 left over have no key
    assert keys.page_keys("acme", None, tokens[:8]) == a
    assert keys.page_keys("globex", None, tokens)[0] != a[0]
    assert keys.page_keys("acme", "", tokens)[0] != a[0]
    assert PrefixKeys(b"t" * 32, 4).page_keys("acme", None, tokens)[0] != a[0]
    # chained: the second page's key depends on the first page's tokens
    assert keys.page_keys("acme", None, [9, *tokens[1:]])[1] != a[1]
    # length-prefixed: tenant "ab" + salt "c" is not tenant "a" + salt "bc"
    assert keys.page_keys("ab", "c", tokens)[0] != keys.page_keys("a", "bc", tokens)[0]
    unscoped = PrefixKeys(b"s" * 32, 4, scope_by_tenant=False)
    assert unscoped.page_keys("acme", None, tokens) == unscoped.page_keys("globex", None, tokens)


# --- the cross-tenant-prefix fault: caught by the read check, and the leak without it ----------


def _cross_tenant(faults: tuple[str, ...]) -> tuple[LLMEngine, Request, Request]:
    engine = make_tiny_engine(**CACHE, faults=faults)
    prompt = prompt_of(50, seed=11)
    victim = ask(engine, prompt, tenant="acme")
    intruder = ask(engine, prompt, tenant="globex", max_tokens=12)
    return engine, victim, intruder


def test_cross_tenant_prefix_is_refused_by_the_read_check() -> None:
    engine, victim, intruder = _cross_tenant(("cross-tenant-prefix",))
    assert victim.error is None
    assert intruder.error is not None and intruder.error.code == "kv_isolation_violation"
    assert intruder.output_ids == []  # failed closed before its first token
    assert counter(engine, "kvfence_kv_foreign_tenant_read") == 1
    assert engine.pages.num_free == engine.pages.num_pages


def test_without_the_fault_the_same_requests_pass_and_nothing_is_counted() -> None:
    engine, victim, intruder = _cross_tenant(())
    assert victim.error is None and intruder.error is None and intruder.cached_tokens == 0
    assert counter(engine, "kvfence_kv_foreign_tenant_read") == 0


def test_cross_tenant_prefix_without_the_read_check_computes_from_the_other_tenants_kv() -> None:
    faults = ("cross-tenant-prefix", "no-tag-check")
    engine = make_tiny_engine(**CACHE, faults=faults)
    prompt = prompt_of(50, seed=11)
    ask(engine, prompt, tenant="acme")
    owner = engine.pages.book.owner
    acme_pages = [p for p in range(engine.pages.kv.num_pages) if int(owner[p]) == SHARED]
    clean = ask(engine, prompt, tenant="globex", max_tokens=12)
    assert clean.error is None and clean.cached_tokens == 3 * PAGE  # a hit on acme's pages
    acme = engine.pages.tenant_id("acme")
    assert all(int(engine.pages.book.page_tenant[p]) == acme for p in acme_pages)
    # globex's answer is a function of the bytes in acme's pages: change them, it changes
    engine.pages.kv.k[:, acme_pages] *= -1.0
    tampered = ask(engine, prompt, tenant="globex", max_tokens=12)
    assert tampered.error is None and tampered.cached_tokens == 3 * PAGE
    assert (logprobs(clean) - logprobs(tampered)).abs().max() > 1e-3
    assert counter(engine, "kvfence_kv_foreign_tenant_read") == 0  # nobody looked


def test_the_read_check_refuses_a_shared_page_of_another_tenant() -> None:
    t = torch.tensor
    page_tenant = t([NO_TENANT, 0, 1])
    common = (t([1, 1, 1]), t([4, 4, 4]), t([1, 1, 1]))
    table, held = t([[1, 0], [2, 0], [1, 0]]), t([[1, 1], [1, 1], [1, 1]])
    check = check_reads(
        *common, table, held, t([2, 2, 2]), t([5, 5, 5]), 4, page_tenant, t([0, 0, 1])
    )
    assert check.foreign.tolist() == [False, True, True]
    assert check.failed.tolist() == [False, True, True]


def test_under_pool_pressure_hits_evictions_and_preemptions_change_no_output() -> None:
    """A pool too small for the batch: requests sharing a system prefix are preempted and
    recomputed, cached pages are evicted and re-published; every answer equals a cold one."""
    # 16 pages: the cache's 8 in two slots of 4, the requests' 8 (128 tokens)
    engine = make_tiny_engine(
        pages=16, prefix_cache=True, prefix_cache_share=0.5, prefix_cache_tenants=2
    )
    cold = make_tiny_engine()
    system = prompt_of(40, seed=30)
    prompts = [system + prompt_of(10 + i, seed=31 + i) for i in range(6)]
    seqs = [
        ask(engine, p, tenant=f"t{i % 2}", max_tokens=16, run=False) for i, p in enumerate(prompts)
    ]
    run_until_done(engine)
    assert counter(engine, "kvfence_preemptions") > 0 and engine.pages.book.evictions > 0
    assert counter(engine, "kvfence_prefix_cache_hit_tokens") > 0
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.error is None
        assert seq.output_ids == ask(cold, prompt, max_tokens=16).output_ids
    assert engine.pages.num_free == engine.pages.num_pages
