"""The prefix cache in the prefill role: a hit computes only the rest of the prompt, yet the
KV exported for decode is the whole prompt's, equal to a cold prefill's; exporting reads the
shared pages without releasing or re-tagging them."""

import torch

from helpers.engines import make_tiny_engine, prompt_of, run_until_done
from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.page_book import SHARED
from kvfence_engine.core.request import Request, SamplingParams, is_terminal

PAGE = 16


def prefill(engine: LLMEngine, prompt: list[int], tenant: str = "acme") -> Request:
    """What /internal/prefill does: one token, and the prompt's KV copied out for decode."""
    seq = engine.admit(prompt, SamplingParams(max_tokens=1), max_tokens=1, tenant=tenant)
    assert not is_terminal(seq), seq.error
    seq.export_kv = True
    engine.add(seq)
    run_until_done(engine)
    assert seq.error is None and seq.exported is not None
    return seq


def test_a_hit_exports_the_whole_prompts_kv_like_a_cold_prefill_and_keeps_the_shared_pages() -> (
    None
):
    engine = make_tiny_engine(role="prefill", prefix_cache=True, prefix_cache_tenants=2)
    prompt = prompt_of(50, seed=51)  # 3 full pages and 2 tokens
    cold = prefill(engine, prompt)
    shared = [p for p in range(engine.pages.num_pages) if int(engine.pages.book.owner[p]) == SHARED]
    tags = engine.pages.book.tags[shared].clone()
    hit = prefill(engine, prompt)
    assert (cold.cached_tokens, hit.cached_tokens) == (0, 3 * PAGE)
    (k0, v0, n0), (k1, v1, n1) = cold.exported, hit.exported  # type: ignore[misc]
    assert n0 == n1 == len(prompt) and k1.shape == k0.shape
    assert torch.allclose(k1, k0, atol=1e-5) and torch.allclose(v1, v0, atol=1e-5)
    assert hit.first_token_at is not None and hit.output_ids == cold.output_ids
    # the shared pages are still cached under the same tags, referenced by nobody, free to
    # allocate; a third request hits them again
    assert len(shared) == 3 and torch.equal(engine.pages.book.tags[shared], tags)
    assert all(not engine.pages.book.holders[p] for p in shared)
    assert engine.pages.num_free == engine.pages.num_pages
    assert prefill(engine, prompt).cached_tokens == 3 * PAGE
    # another tenant's identical prompt: computed in full, nothing shared with it
    assert prefill(engine, prompt, tenant="globex").cached_tokens == 0
