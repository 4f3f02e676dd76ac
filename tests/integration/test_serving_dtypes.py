"""Narrower dtypes through a real server: a bfloat16 KV pool (--kv-cache-dtype) holds twice
the tokens in the same budget and still serves; int8 weights (--weight-dtype) answer as the
in-process packed engine does (tests/unit/engine/test_int8_weights.py) and say so."""

from pathlib import Path

import httpx
import openai

from helpers.engines import generate, make_tiny_engine, prompt_of, tiny_budget
from helpers.processes import serve


def test_a_bfloat16_pool_holds_twice_the_tokens_of_float32_and_serves(logs_dir, tiny_server):
    budget = str(tiny_budget(64))  # 64 float32 pages
    with serve(
        logs_dir, "tiny-bf16", "--model", "builtin:tiny-random", "--context-length", "512",
        "--kv-cache-memory", budget, "--kv-cache-dtype", "bfloat16",
    ) as proc:  # fmt: skip
        narrow = httpx.get(proc.url + "/v1/kvpool").json()
        wide = httpx.get(tiny_server.url + "/v1/kvpool").json()
        assert (narrow["kv_dtype"], wide["kv_dtype"]) == ("bfloat16", "float32")
        assert narrow["kv_bytes_per_token"] * 2 == wide["kv_bytes_per_token"]
        assert narrow["pool_tokens"] == 2 * wide["pool_tokens"] == 2048
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        answer = client.completions.create(
            model="tiny-random", prompt=[11] * 300, max_tokens=40, temperature=0
        )
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == 300 and answer.usage.completion_tokens == 40


def test_serve_with_int8_weights_answers_and_reports_them(logs_dir: Path) -> None:
    with serve(
        logs_dir,
        "tiny-int8",
        "--model",
        "builtin:tiny-random",
        "--weight-dtype",
        "int8",
        "--kv-cache-memory",
        "16Mi",
    ) as proc:
        assert httpx.get(proc.url + "/v1/kvpool").json()["weight_dtype"] == "int8"
        body = {"prompt": prompt_of(20), "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(proc.url + "/v1/completions", json=body, timeout=60).json()
    assert answer["usage"]["completion_tokens"] == 5
    engine = make_tiny_engine(weight_dtype="int8")
    expected = generate(engine, prompt_of(20), 5, ignore_eos=True).output_ids
    assert answer["choices"][0]["text"] == engine.tokenizer.decode(expected)
