"""Prime and probe through the prefix cache (issue 33, finding 1), against real router, prefill
and decode processes and the official openai client.

Tenant B fills its cache with one-page marker prompts, lets tenant A work (or not), then sends
its markers again, newest first, and reads its own usage.prompt_tokens_details.cached_tokens:
16 is "still cached", 0 is "evicted". On the shared LRU this was written against, B's count
of evicted markers was the number of pages A's requests took. Now the cache is a partition of
the pool that no request's allocation takes, and a tenant's pages are evicted only by its own
publishing: B's count is the same whatever A did, with the cache on and with it off. The
negative control, `shared-cache-eviction`, opens the partition to allocations again, and B's
count then tells A's work from A's silence.
"""

import concurrent.futures
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from helpers.deployments import Deployment, start_deployment, two_tenant_router_args
from helpers.engines import prompt_of
from helpers.openai_usage import cached_tokens
from helpers.processes import metric

KEY_A, KEY_B, TOKEN = "probe-key-a", "probe-key-b", "probe-internal-token"
PAGE = 16
MARKERS = 8  # B's whole quota: 64 pages, the cache's 16 in 2 slots of 8
A_PROMPT_TOKENS = 480  # 30 pages: two at once need more than the 56 pages the cache left free


@pytest.fixture(scope="module")
def router_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return two_tenant_router_args(tmp_path_factory.mktemp("prime-and-probe"), KEY_A, KEY_B, TOKEN)


def complete(client: openai.OpenAI, prompt: list[int]) -> int:
    answer = client.completions.create(
        model="tiny-random", prompt=prompt, max_tokens=1, temperature=0
    )
    return cached_tokens(answer.usage)


def markers() -> list[list[int]]:
    """One full page and one token each: a cached marker is a hit of exactly one page."""
    return [prompt_of(PAGE + 1, seed=9000 + i) for i in range(MARKERS)]


def a_works(d: Deployment) -> None:
    """A's requests: two pool-filling prompts at once, twice (the second time a hit on A's
    own cache), and one more of another prompt."""
    a = d.client(KEY_A)
    prompts = [prompt_of(A_PROMPT_TOKENS, seed=9100 + i) for i in range(2)]
    for _ in range(2):
        complete_together(a, prompts)
    complete(a, prompt_of(A_PROMPT_TOKENS, seed=9102))


def complete_together(client: openai.OpenAI, prompts: list[list[int]]) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: complete(client, p), prompts))


BATCHED_PAIR_TRIES = 40


def a_works_until_a_pair_is_prefilled_together(d: Deployment) -> None:
    """A's pool-filling prompts, two at once, fresh ones each time, until the prefill engine
    has taken a pair in one step: only then do A's requests hold more pages at once than the
    pool has left (sent at once, on a loaded machine they can reach it a step apart, and each
    then fits alone)."""
    a = d.client(KEY_A)
    url = d.prefills[0].url
    for attempt in range(BATCHED_PAIR_TRIES):
        seeds = (9200 + 2 * attempt, 9201 + 2 * attempt)
        complete_together(a, [prompt_of(A_PROMPT_TOKENS, seed=s) for s in seeds])
        steps = metric(url, "kvfence_prefill_batch_requests_count")
        single = metric(url, 'kvfence_prefill_batch_requests_bucket{le="1.0"}')
        if steps > single:
            return
    pytest.fail(f"no pair of A's prompts was prefilled in one step in {BATCHED_PAIR_TRIES} tries")


def evicted_markers(
    logs: Path, router_args: list[str], name: str, a_active: bool, engine_args: list[str],
    faults: tuple[str, ...] = (), a_work: Callable[[Deployment], None] = a_works,
) -> int:  # fmt: skip
    """B's estimate of A's pages: how many of its markers it finds evicted."""
    d = start_deployment(
        logs,
        name,
        decode_pages=128,  # decode is never the bottleneck: the prefill's pool is probed
        router_args=router_args,
        engine_args=engine_args,
        prefill_faults=faults,
    )
    try:
        b = d.client(KEY_B)
        primed = markers()
        for marker in primed:
            assert complete(b, marker) == 0
        if a_active:
            a_work(d)
        return sum(complete(b, marker) == 0 for marker in reversed(primed))
    finally:
        d.stop()


CACHE_ON = ["--prefix-cache", "--prefix-cache-tenants", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("engine_args", [CACHE_ON, []], ids=["cache-on", "cache-off"])
def test_b_reads_nothing_of_what_a_did(
    logs_dir: Path, router_args: list[str], engine_args: list[str]
) -> None:
    label = "on" if engine_args else "off"
    quiet = evicted_markers(logs_dir, router_args, f"probe-{label}-quiet", False, engine_args)
    busy = evicted_markers(logs_dir, router_args, f"probe-{label}-busy", True, engine_args)
    assert quiet == busy, f"B counted {quiet} evicted markers with A quiet, {busy} with A busy"
    assert quiet == (0 if engine_args else MARKERS)  # cached, or never cached at all


@pytest.mark.slow
def test_with_the_shared_cache_eviction_fault_b_counts_as_pages(
    logs_dir: Path, router_args: list[str]
) -> None:
    fault = ("shared-cache-eviction",)
    quiet = evicted_markers(logs_dir, router_args, "probe-fault-quiet", False, CACHE_ON, fault)
    busy = evicted_markers(
        logs_dir, router_args, "probe-fault-busy", True, CACHE_ON, fault,
        a_work=a_works_until_a_pair_is_prefilled_together,
    )  # fmt: skip
    assert quiet == 0 and busy > 0, (quiet, busy)
