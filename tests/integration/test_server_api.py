"""The HTTP contract of `kvfence serve`, against a real process and the official openai client."""

import json
import re

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.completion_create_params import CompletionCreateParamsBase

from helpers.engines import TINY_TOKEN_BYTES, tiny_budget
from helpers.processes import metric, serve
from helpers.waits import READY_S
from kvfence_engine.loading.loader import tiny_random
from kvfence_engine.tools.localproc import LocalProcess

CONTEXT = 512


@pytest.fixture(scope="module")
def client(tiny_server: LocalProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_reports_the_real_prompt_token_count(client: openai.OpenAI) -> None:
    prompt = "Tenant isolation is a property of the whole system."
    r = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=5, temperature=0)
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tiny_random().tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"
    assert r.choices[0].finish_reason in ("length", "stop")


def test_streamed_text_equals_the_non_streamed_text(client: openai.OpenAI) -> None:
    kwargs: CompletionCreateParamsBase = {
        "model": "tiny-random",
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_streaming_with_usage_matches_non_streaming(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(
        model="tiny-random", messages=messages, max_tokens=10, temperature=0
    )
    stream = client.chat.completions.create(
        model="tiny-random",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == whole.choices[0].message.content
    assert whole.usage is not None
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens


def test_logprobs_come_back_for_completions_and_chat(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="tiny-random", prompt="a b c", max_tokens=4, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    c = client.chat.completions.create(
        model="tiny-random",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    chat_logprobs = c.choices[0].logprobs
    assert chat_logprobs is not None and chat_logprobs.content is not None
    content = chat_logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_seeded_sampling_is_reproducible_over_http(client: openai.OpenAI) -> None:
    kwargs: CompletionCreateParamsBase = {
        "model": "tiny-random",
        "prompt": "hello",
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 42,
    }
    assert client.completions.create(**kwargs).choices[0].text == (
        client.completions.create(**kwargs).choices[0].text
    )


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    kwargs: CompletionCreateParamsBase = {
        "model": "tiny-random",
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0,
    }
    free = client.completions.create(**kwargs).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), "need a visible stop string"
    stopped: CompletionCreateParamsBase = {**kwargs, "stop": [stop]}
    r = client.completions.create(**stopped)
    assert r.choices[0].text == free[: free.find(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("length", [CONTEXT + 1, 2 * CONTEXT])
def test_over_limit_prompts_get_400_and_no_page(
    tiny_server: LocalProcess, client: openai.OpenAI, length: int
) -> None:
    before = metric(tiny_server.url, "kvfence_kv_pages_used")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-random", prompt=[500] * length, max_tokens=4)
    assert err.value.code == "context_length_exceeded"
    assert metric(tiny_server.url, "kvfence_kv_pages_used") == before


def test_a_prompt_one_under_the_limit_is_served(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny-random", prompt=[500] * (CONTEXT - 1), max_tokens=4)
    assert r.usage is not None
    assert r.usage.prompt_tokens == CONTEXT - 1 and r.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{not json", None),
        (json.dumps({"prompt": "x", "max_tokens": "many"}), "max_tokens"),
        (json.dumps({"prompt": "x", "temperature": -1}), "temperature"),
        (json.dumps({"max_tokens": 3}), "prompt"),
        (json.dumps({"prompt": [1, 2, 10**9]}), "prompt"),
        (json.dumps({"prompt": "x", "n": 3}), "n"),
    ],
)
def test_malformed_requests_get_400_in_openai_shape(
    tiny_server: LocalProcess, body: str, param: str | None
) -> None:
    r = httpx.post(
        tiny_server.url + "/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] == param


def test_unknown_paths_get_404_in_openai_shape(tiny_server: LocalProcess) -> None:
    r = httpx.get(tiny_server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_models_advertise_the_effective_context(
    client: openai.OpenAI, tiny_server: LocalProcess
) -> None:
    data = httpx.get(tiny_server.url + "/v1/models").json()["data"]
    assert data[0]["max_model_len"] == CONTEXT
    assert client.models.list().data[0].id == "tiny-random"


def test_kvpool_reports_the_allocated_pool(tiny_server: LocalProcess) -> None:
    report = httpx.get(tiny_server.url + "/v1/kvpool").json()
    assert report["pool_tokens"] == report["num_pages"] * report["page_size"] == 64 * 16
    assert report["kv_bytes_per_token"] == TINY_TOKEN_BYTES
    assert report["context_length_requested"] == report["context_length_effective"] == CONTEXT
    assert report["context_policy"] == "refuse" and report["tag_check"] is True
    assert {
        "role",
        "revision",
        "free_pages",
        "kv_dtype",
        "model_max_positions",
        "kv_checksum",
        "deferred_release",
    } <= report.keys()


CONTRACT_METRICS = [
    "kvfence_kv_pool_tokens",
    "kvfence_kv_pages_used",
    "kvfence_context_length_tokens",
    "kvfence_kv_tag_mismatch_total",
    "kvfence_kv_unwritten_read_total",
    "kvfence_transfer_checksum_verified_total",
    "kvfence_transfer_checksum_failed_total",
    "kvfence_transfer_count_mismatch_total",
    "kvfence_late_writes_dropped_total",
    "kvfence_requests_rejected_total",
    "kvfence_time_to_first_token_seconds_bucket",
    "kvfence_prompt_tokens_total",
    "kvfence_engine_step_seconds_total",
    "kvfence_kv_read_check_seconds_total",
    "kvfence_generation_tokens_total",
]


def test_metrics_expose_every_contract_series(
    tiny_server: LocalProcess, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-random", prompt=[500] * (CONTEXT + 1))
    text = httpx.get(tiny_server.url + "/metrics").text
    for name in CONTRACT_METRICS:
        assert re.search(rf"^{name}[{{ ]", text, re.M), name
    assert metric(tiny_server.url, "kvfence_kv_pool_tokens") == 1024


def test_the_engine_times_its_steps_and_the_read_check_inside_them(
    tiny_server: LocalProcess, client: openai.OpenAI
) -> None:
    """What bench/isolation_overhead.py reads to measure the check's share of step time."""

    def seconds() -> tuple[float, float]:
        return (
            metric(tiny_server.url, "kvfence_kv_read_check_seconds_total"),
            metric(tiny_server.url, "kvfence_engine_step_seconds_total"),
        )

    check_before, step_before = seconds()
    client.completions.create(model="tiny-random", prompt=[500] * 50, max_tokens=8, temperature=0)
    check_after, step_after = seconds()
    check, step = check_after - check_before, step_after - step_before
    assert 0 < check < step, (check, step)


def test_a_client_that_disconnects_mid_stream_gets_its_pages_released(
    tiny_server: LocalProcess,
) -> None:
    body = {"prompt": [500] * 100, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(tiny_server.url, "kvfence_kv_pages_used") > 0
    for _ in range(50):
        if metric(tiny_server.url, "kvfence_kv_pages_used") == 0:
            break
        httpx.get(tiny_server.url + "/healthz")
    assert metric(tiny_server.url, "kvfence_kv_pages_used") == 0


def test_unsafe_faults_are_refused_at_start_without_the_switch(logs_dir) -> None:
    proc = serve(
        logs_dir, "refused", "--model", "builtin:tiny-random", "--unsafe-fault", "no-tag-check"
    ).start()
    assert proc.proc is not None and proc.proc.wait(timeout=READY_S) == 2
    assert "KVFENCE_ALLOW_UNSAFE" in (logs_dir / "refused.log").read_text()


def test_a_running_engine_refuses_to_switch_a_fault_on_without_the_switch(
    tiny_server: LocalProcess,
) -> None:
    """The test-only switch of a running engine (POST /internal/unsafe-fault) is refused, in
    the API's shape, by an engine started without KVFENCE_ALLOW_UNSAFE=1, and nothing is on."""
    r = httpx.post(tiny_server.url + "/internal/unsafe-fault", json={"fault": "early-release"})
    assert r.status_code == 403, r.text
    assert "KVFENCE_ALLOW_UNSAFE=1" in r.json()["error"]["message"]
    pool = httpx.get(tiny_server.url + "/v1/kvpool").json()
    assert pool["unsafe_faults"] == []


def test_reject_placeholder_over_http_is_a_500_isolation_violation(logs_dir) -> None:
    with serve(
        logs_dir,
        "placeholder",
        "--model",
        "builtin:tiny-random",
        "--context-length",
        "64",
        "--kv-cache-memory",
        str(tiny_budget(64)),
        "--unsafe-fault",
        "reject-placeholder",
        unsafe=True,
    ) as proc:
        r = httpx.post(proc.url + "/v1/completions", json={"prompt": [500] * 100, "max_tokens": 5})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "kv_isolation_violation"
        assert metric(proc.url, "kvfence_kv_unwritten_read_total") == 1
        assert metric(proc.url, "kvfence_kv_pages_used") == 0
