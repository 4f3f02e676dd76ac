"""The prefix cache over HTTP: a real `kvfence serve --prefix-cache` and the official openai
client. A repeated prompt reports usage.prompt_tokens_details.cached_tokens > 0; a different
cache_salt (the only other scope a combined engine, which serves one tenant, can show) and an
engine without the cache report 0. The disaggregated roles: test_prefix_cache_disaggregated."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat import completion_create_params as chat_params

from helpers.engines import prompt_of, tiny_budget
from helpers.openai_usage import cached_tokens
from helpers.processes import metric, serve
from helpers.waits import READY_S
from kvfence_engine.tools.localproc import LocalProcess

ENGINE_ARGS = ("--model", "builtin:tiny-random", "--context-length", "512")


@pytest.fixture(scope="module")
def cached_server(logs_dir: Path) -> Iterator[LocalProcess]:
    budget = str(tiny_budget(64))
    with serve(
        logs_dir, "prefix", *ENGINE_ARGS, "--kv-cache-memory", budget, "--prefix-cache"
    ) as p:
        yield p


def client_of(proc: LocalProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)


def test_a_repeated_completion_prompt_reports_cached_tokens(cached_server: LocalProcess) -> None:
    client = client_of(cached_server)
    prompt = prompt_of(100, seed=21)  # 6 full pages of 16
    ask = lambda: client.completions.create(  # noqa: E731
        model="tiny-random", prompt=prompt, max_tokens=6, temperature=0
    )
    first, again = ask(), ask()
    assert cached_tokens(first.usage) == 0
    assert cached_tokens(again.usage) == 96
    assert again.choices[0].text == first.choices[0].text
    assert metric(cached_server.url, "kvfence_prefix_cache_hit_tokens_total") >= 96
    assert metric(cached_server.url, "kvfence_prefix_cache_queried_tokens_total") >= 200
    report = httpx.get(cached_server.url + "/v1/kvpool").json()
    assert report["prefix_cache"] is True and report["cached_pages"] >= 6


def test_a_repeated_chat_reports_cached_tokens_whole_and_streamed(
    cached_server: LocalProcess,
) -> None:
    client = client_of(cached_server)
    system = "You are a careful assistant. " * 20
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hello."},
    ]
    kwargs: chat_params.CompletionCreateParamsBase = {
        "model": "tiny-random",
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
    }
    first = client.chat.completions.create(**kwargs)
    assert cached_tokens(first.usage) == 0
    again = client.chat.completions.create(**kwargs)
    assert cached_tokens(again.usage) > 0
    streamed: chat_params.CompletionCreateParamsStreaming = {
        **kwargs,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = client.chat.completions.create(**streamed)
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and cached_tokens(usage[0]) == cached_tokens(again.usage)


def test_another_cache_salt_gets_no_hit_and_its_own_salt_does(
    cached_server: LocalProcess,
) -> None:
    client = client_of(cached_server)
    prompt = prompt_of(64, seed=22)

    def ask(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        r = client.completions.create(
            model="tiny-random", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
        return cached_tokens(r.usage)

    assert ask("alice") == 0
    assert ask("bob") == 0
    assert ask(None) == 0
    assert ask("alice") == 48
    r = httpx.post(cached_server.url + "/v1/completions", json={"prompt": prompt, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_without_the_flag_nothing_is_cached(tiny_server: LocalProcess) -> None:
    client = client_of(tiny_server)
    prompt = prompt_of(100, seed=23)
    for _ in range(2):
        r = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=2)
        assert cached_tokens(r.usage) == 0
    assert httpx.get(tiny_server.url + "/v1/kvpool").json()["prefix_cache"] is False


def test_the_prefix_cache_is_a_logged_no_op_in_the_decode_role(logs_dir: Path) -> None:
    with serve(
        logs_dir, "prefix-decode", *ENGINE_ARGS, "--role", "decode", "--prefix-cache"
    ) as proc:
        assert httpx.get(proc.url + "/v1/kvpool").json()["prefix_cache"] is False
    assert (
        "--prefix-cache: no effect in the decode role, which receives each prompt's whole KV "
        "from prefill (where the cache is)" in (logs_dir / "prefix-decode.log").read_text()
    )


def test_an_unusable_prefix_cache_secret_is_a_usage_error(logs_dir: Path, tmp_path: Path) -> None:
    short = tmp_path / "short-secret"
    short.write_bytes(b"too short")
    cases = {
        "prefix-short": ("--prefix-cache", "--prefix-cache-secret-file", str(short)),
        "prefix-missing": ("--prefix-cache", "--prefix-cache-secret-file", str(tmp_path / "no")),
        "prefix-alone": ("--prefix-cache-secret-file", str(short)),
    }
    for name, flags in cases.items():
        proc = serve(logs_dir, name, *ENGINE_ARGS, *flags).start()
        assert proc.proc is not None and proc.proc.wait(timeout=READY_S) == 2, name
        last = (logs_dir / f"{name}.log").read_text().strip().splitlines()[-1]
        assert last.startswith("kvfence serve: ") and "Traceback" not in last, last
    assert "at least 16 bytes" in (logs_dir / "prefix-short.log").read_text()
    assert "needs --prefix-cache" in (logs_dir / "prefix-alone.log").read_text()
