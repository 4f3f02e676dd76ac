"""Router + prefill + decode as real processes: same tokens as the combined engine, admission
before reservation on every hop, and tenants, tokens and dead instances handled cleanly."""

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helpers.deployments import Deployment, start_deployment
from helpers.processes import metric
from kvfence_engine.tools.localproc import LocalProcess

CONTEXT = 512
PROMPTS = ["Hello there", "The capital of France is", "word " * 150, "1 2 3 4 5 6 7 8 9 10"]


@pytest.fixture(scope="module")
def one_by_one(logs_dir: Path) -> Iterator[Deployment]:
    d = start_deployment(logs_dir, "1p1d")
    yield d
    d.stop()


def greedy(client: openai.OpenAI, prompt: str) -> tuple[str, list[float]]:
    r = client.completions.create(
        model="tiny-random",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    return r.choices[0].text, logprobs.token_logprobs


def pages_used(proc: LocalProcess, token: str | None = None) -> float:
    return metric(proc.url, "kvfence_kv_pages_used", token)


def test_one_prefill_one_decode_answer_exactly_like_the_combined_engine(
    one_by_one: Deployment, tiny_server: LocalProcess
) -> None:
    combined = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    for prompt in PROMPTS:
        assert greedy(one_by_one.client(), prompt) == greedy(combined, prompt)
    assert metric(one_by_one.decodes[0].url, "kvfence_transfer_checksum_verified_total") > 0
    assert all(pages_used(p) == 0 for p in (*one_by_one.prefills, *one_by_one.decodes))


def test_two_prefill_two_decode_answer_alike_and_share_the_load(
    logs_dir: Path, tiny_server: LocalProcess
) -> None:
    d = start_deployment(logs_dir, "2p2d", prefills=2, decodes=2)
    try:
        combined = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
        prompts = PROMPTS * 3
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            ours = list(pool.map(lambda p: greedy(d.client(), p), prompts))
        theirs = [greedy(combined, p) for p in prompts]
        # same tokens; logprobs only to float rounding (batched decode pads differently)
        assert [text for text, _ in ours] == [text for text, _ in theirs]
        for (_, a), (_, b) in zip(ours, theirs, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
        for proc in (*d.prefills, *d.decodes):
            assert metric(proc.url, "kvfence_prompt_tokens_total") > 0, proc.describe()
            assert pages_used(proc) == 0
    finally:
        d.stop()


@pytest.mark.parametrize("length", [CONTEXT + 1, 2 * CONTEXT])
def test_over_limit_prompts_get_400_from_the_router_and_touch_no_engine(
    one_by_one: Deployment, length: int
) -> None:
    decode, prefill = one_by_one.decodes[0], one_by_one.prefills[0]
    before = metric(decode.url, "kvfence_prompt_tokens_total")
    with pytest.raises(openai.BadRequestError) as err:
        one_by_one.client().completions.create(model="tiny-random", prompt=[500] * length)
    assert err.value.code == "context_length_exceeded"
    assert metric(decode.url, "kvfence_prompt_tokens_total") == before
    assert pages_used(decode) == pages_used(prefill) == 0


@pytest.mark.parametrize("length", [CONTEXT + 1, 2 * CONTEXT])
def test_over_limit_prompts_get_400_from_decode_and_prefill_when_the_router_is_bypassed(
    one_by_one: Deployment, length: int
) -> None:
    decode, prefill = one_by_one.decodes[0], one_by_one.prefills[0]
    r = httpx.post(
        decode.url + "/internal/reserve",
        json={"request_id": "bypass", "prompt_ids": [500] * length},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    handle = {
        "request_id": "bypass",
        "seq_id": 1,
        "pages": [0],
        "tags": [1],
        "reserved_tokens": length,
        "transfer_port": 9,
    }
    r = httpx.post(
        prefill.url + "/internal/prefill", json={"handle": handle, "prompt_ids": [500] * length}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert pages_used(decode) == pages_used(prefill) == 0


def test_a_prompt_larger_than_decodes_pool_is_refused_by_decode_before_prefill(
    logs_dir: Path,
) -> None:
    # the router serves 512 tokens, decode's pool holds 256: decode refuses, prefill untouched
    d = start_deployment(
        logs_dir, "small-decode", decode_pages=16, router_args=["--context-length", str(CONTEXT)]
    )
    try:
        with pytest.raises(openai.BadRequestError) as err:
            d.client().completions.create(model="tiny-random", prompt=[500] * 300)
        assert err.value.code == "context_length_exceeded" and "KV pool" in err.value.message
        assert metric(d.prefills[0].url, "kvfence_prompt_tokens_total") == 0
        bypass = httpx.post(
            d.decodes[0].url + "/internal/reserve",
            json={"request_id": "direct", "prompt_ids": [500] * 300},
        )
        assert bypass.status_code == 400 and "KV pool" in bypass.json()["error"]["message"]
        assert pages_used(d.decodes[0]) == pages_used(d.prefills[0]) == 0
    finally:
        d.stop()


def test_internal_endpoints_refuse_calls_without_the_token(logs_dir: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    d = start_deployment(logs_dir, "token", token_file=token)
    try:
        body = {"request_id": "no-token", "prompt_ids": [1, 2, 3]}
        r = httpx.post(d.decodes[0].url + "/internal/reserve", json=body)
        assert r.status_code == 401
        r = httpx.post(
            d.decodes[0].url + "/internal/reserve",
            json=body,
            headers={"X-Kvfence-Internal-Token": "wrong"},
        )
        assert r.status_code == 401
        assert d.client().completions.create(model="tiny-random", prompt="hi", max_tokens=3).usage
        assert pages_used(d.decodes[0], token="s3cret") == 0
    finally:
        d.stop()


def test_tenants_need_a_valid_api_key(logs_dir: Path, tmp_path: Path) -> None:
    keys, token = tmp_path / "keys", tmp_path / "token"
    keys.write_text("# key tenant\nkey-a tenant-a\nkey-b tenant-b\n")
    token.write_text("s3cret\n")
    d = start_deployment(logs_dir, "keys", router_args=["--api-keys", str(keys)], token_file=token)
    try:
        with pytest.raises(openai.AuthenticationError):
            d.client("nope").completions.create(model="tiny-random", prompt="hi", max_tokens=2)
        r = httpx.post(d.router.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = d.client("key-b").completions.create(model="tiny-random", prompt="hi", max_tokens=2)
        assert ok.usage is not None and ok.usage.completion_tokens == 2
        scrape = {"Authorization": "Bearer s3cret"}  # the internal token, as Prometheus sends it
        assert 'tenant="tenant-b"' in httpx.get(d.router.url + "/metrics", headers=scrape).text
        assert (
            httpx.get(
                d.router.url + "/metrics", headers={"Authorization": "Bearer key-b"}
            ).status_code
            == 403
        )
    finally:
        d.stop()


def test_a_dead_decode_instance_leaves_rotation_and_requests_still_succeed(
    logs_dir: Path,
) -> None:
    d = start_deployment(logs_dir, "dead-decode", decodes=2)
    try:
        d.decodes[1].kill()
        for _ in range(4):
            r = d.client().completions.create(model="tiny-random", prompt="hi", max_tokens=3)
            assert r.usage is not None and r.usage.completion_tokens == 3
        d.decodes[0].kill()
        with pytest.raises(openai.InternalServerError) as err:
            d.client().completions.create(model="tiny-random", prompt="hi", max_tokens=3)
        assert err.value.status_code == 503
    finally:
        d.stop()


def test_token_ids_outside_the_vocabulary_are_a_400_at_every_hop(one_by_one: Deployment) -> None:
    with pytest.raises(openai.BadRequestError):
        one_by_one.client().completions.create(model="tiny-random", prompt=[1, 2, 10**7])
    r = httpx.post(
        one_by_one.decodes[0].url + "/internal/reserve",
        json={"request_id": "bad-ids", "prompt_ids": [1, -5]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    ok = one_by_one.client().completions.create(
        model="tiny-random", prompt="still fine", max_tokens=2
    )
    assert ok.usage is not None and ok.usage.completion_tokens == 2
