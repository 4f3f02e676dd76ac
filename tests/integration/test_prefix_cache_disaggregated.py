"""The prefix cache in a disaggregated deployment, as real router + prefill + decode processes
and the official openai client: a tenant's later turn is prefilled from its own cached pages and
answers exactly like a cold engine; another tenant sending the same prompt gets no hit; and the
cross-tenant-prefix fault on prefill is caught by the read check, or, with no-tag-check too,
shows the leak in the intruder's own usage."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionMessageParam

from helpers.deployments import Deployment, start_deployment, two_tenant_router_args
from helpers.engines import prompt_of
from helpers.openai_usage import cached_tokens
from helpers.processes import metric
from kvfence_engine.tools.localproc import LocalProcess

KEY_A, KEY_B, TOKEN = "prefix-key-a", "prefix-key-b", "prefix-internal-token"
PROMPT = prompt_of(100, seed=41)  # 6 full pages of 16, and 4 tokens on a seventh
SYSTEM = "You are a careful assistant who answers in full sentences. " * 8


@pytest.fixture(scope="module")
def router_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return two_tenant_router_args(tmp_path_factory.mktemp("prefix-disagg"), KEY_A, KEY_B, TOKEN)


def cached_deployment(
    logs: Path, name: str, router_args: list[str], faults: tuple[str, ...] = ()
) -> Deployment:
    # one set of flags for both roles, as a manifest's engine.extraArgs gives: decode takes
    # --prefix-cache as a no-op (it computes no prompt) and reports the cache off
    return start_deployment(
        logs,
        name,
        router_args=router_args,
        engine_args=["--prefix-cache", "--prefix-cache-tenants", "2"],
        prefill_faults=faults,
    )


@pytest.fixture(scope="module")
def cached(logs_dir: Path, router_args: list[str]) -> Iterator[Deployment]:
    d = cached_deployment(logs_dir, "prefix-disagg", router_args)
    yield d
    d.stop()


class ChatArgs(TypedDict):
    """What every chat request of a test sends, besides its messages."""

    model: str
    max_tokens: int
    temperature: float


def complete(client: openai.OpenAI, prompt: list[int], **extra: Any) -> Completion:
    return client.completions.create(
        model="tiny-random",
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, **extra},
    )


def scrape(url: str, name: str) -> float:
    return metric(url, name, TOKEN)


def test_a_tenants_second_turn_is_prefilled_from_its_cache_and_answers_like_a_cold_engine(
    cached: Deployment, tiny_server: LocalProcess
) -> None:
    a = cached.client(KEY_A)
    cold = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    turn1: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hello."},
    ]
    kwargs: ChatArgs = {"model": "tiny-random", "max_tokens": 6, "temperature": 0}
    first = a.chat.completions.create(messages=turn1, **kwargs)
    assert cached_tokens(first.usage) == 0
    turn2: list[ChatCompletionMessageParam] = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    second = a.chat.completions.create(messages=turn2, **kwargs)
    assert first.usage is not None
    assert cached_tokens(second.usage) >= 16 * (first.usage.prompt_tokens // 16)
    reference = cold.chat.completions.create(messages=turn2, **kwargs)
    assert second.choices[0].message.content == reference.choices[0].message.content
    stream = a.chat.completions.create(
        messages=turn2,
        stream=True,
        stream_options={"include_usage": True},
        **kwargs,
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    # turn 2's own full pages are cached now too (at least one token is always computed)
    assert len(usage) == 1 and cached_tokens(usage[0]) == 16 * ((usage[0].prompt_tokens - 1) // 16)


def test_a_repeated_prompt_hits_for_its_tenant_only_with_the_same_greedy_answer(
    cached: Deployment,
) -> None:
    a, b = cached.client(KEY_A), cached.client(KEY_B)
    cold = complete(a, PROMPT)
    again = complete(a, PROMPT)
    assert cached_tokens(cold.usage) == 0
    assert cached_tokens(again.usage) == 96  # every full page; the last 4 tokens computed
    assert again.choices[0].text == cold.choices[0].text
    again_lp, cold_lp = again.choices[0].logprobs, cold.choices[0].logprobs
    assert again_lp is not None and cold_lp is not None
    assert again_lp.tokens == cold_lp.tokens
    assert again_lp.token_logprobs is not None and cold_lp.token_logprobs is not None
    pairs = zip(again_lp.token_logprobs, cold_lp.token_logprobs, strict=True)
    assert max(abs(x - y) for x, y in pairs) < 1e-4
    other = complete(b, PROMPT)  # tenant B, A's exact prompt: no hit, computed in full
    assert cached_tokens(other.usage) == 0
    assert other.choices[0].text == cold.choices[0].text
    # a cache_salt narrows within the tenant: A with a salt misses its own unsalted pages
    assert cached_tokens(complete(a, PROMPT, cache_salt="narrow").usage) == 0
    assert cached_tokens(complete(a, PROMPT, cache_salt="narrow").usage) == 96


def test_hit_rates_are_reported_per_role_and_pages_are_not_leaked(cached: Deployment) -> None:
    complete(cached.client(KEY_A), prompt_of(40, seed=42))
    complete(cached.client(KEY_A), prompt_of(40, seed=42))
    prefill, decode = cached.prefills[0], cached.decodes[0]
    assert scrape(prefill.url, "kvfence_prefix_cache_hit_tokens_total") >= 32
    assert scrape(prefill.url, "kvfence_prefix_cache_queried_tokens_total") >= 80
    assert scrape(decode.url, "kvfence_prefix_cache_queried_tokens_total") == 0
    labels = f'{{backend="{prefill.url}",role="prefill"}}'
    for name in ("hit_tokens", "queried_tokens"):
        ours = scrape(cached.router.url, f"kvfence_backend_prefix_cache_{name}_total{labels}")
        assert ours == scrape(prefill.url, f"kvfence_prefix_cache_{name}_total")
    # the cache is on where prompts are computed; a tenant may know (its hits show anyway)
    view = httpx.get(
        cached.router.url + "/v1/kvpool", headers={"Authorization": f"Bearer {KEY_B}"}
    ).json()
    assert [(b["role"], b["report"]["prefix_cache"]) for b in view["backends"]] == [
        ("prefill", True),
        ("decode", False),
    ]
    # cached pages are free to allocate: nothing is held once every request is over
    for proc in (prefill, decode):
        assert scrape(proc.url, "kvfence_kv_pages_used") == 0


def test_no_response_header_says_which_engine_served(cached: Deployment) -> None:
    places = [p.url.removeprefix("http://") for p in (*cached.prefills, *cached.decodes)]
    places += [p.url.rsplit(":", 1)[1] for p in (*cached.prefills, *cached.decodes)]
    auth = {"Authorization": f"Bearer {KEY_A}"}
    for stream in (False, True):
        body = {"prompt": PROMPT, "max_tokens": 2, "stream": stream}
        r = httpx.post(cached.router.url + "/v1/completions", json=body, headers=auth)
        assert r.status_code == 200
        headers = " ".join(f"{k}: {v}" for k, v in r.headers.items())
        assert not [place for place in places if place in headers], headers


def test_cross_tenant_prefix_on_prefill_is_refused_by_the_read_check(
    logs_dir: Path, router_args: list[str]
) -> None:
    d = cached_deployment(logs_dir, "prefix-cross", router_args, ("cross-tenant-prefix",))
    try:
        complete(d.client(KEY_A), PROMPT)
        with pytest.raises(openai.InternalServerError) as err:
            complete(d.client(KEY_B), PROMPT)
        assert err.value.code == "kv_isolation_violation"
        prefill = d.prefills[0]
        assert scrape(prefill.url, "kvfence_kv_foreign_tenant_read_total") == 1
        labels = f'{{backend="{prefill.url}",role="prefill"}}'
        assert scrape(d.router.url, f"kvfence_backend_kv_foreign_tenant_read_total{labels}") == 1
        for proc in (*d.prefills, *d.decodes):
            assert scrape(proc.url, "kvfence_kv_pages_used") == 0
        # the refusal touched no shared page: A still hits its own
        assert cached_tokens(complete(d.client(KEY_A), PROMPT).usage) == 96
    finally:
        d.stop()


def test_cross_tenant_prefix_without_the_read_check_shows_the_leak(
    logs_dir: Path, router_args: list[str]
) -> None:
    faults = ("cross-tenant-prefix", "no-tag-check")
    d = cached_deployment(logs_dir, "prefix-leak", router_args, faults)
    try:
        victim = complete(d.client(KEY_A), PROMPT)
        intruder = complete(d.client(KEY_B), PROMPT)
        assert cached_tokens(intruder.usage) == 96  # B was served from A's pages
        assert intruder.choices[0].text == victim.choices[0].text
        assert scrape(d.prefills[0].url, "kvfence_kv_foreign_tenant_read_total") == 0
    finally:
        d.stop()
