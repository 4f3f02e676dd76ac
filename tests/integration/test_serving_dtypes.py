"""--kv-cache-dtype: a narrower KV pool holds more tokens in the same budget and still serves."""

import httpx
import openai

from helpers.engines import tiny_budget
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
        assert answer.usage.prompt_tokens == 300 and answer.usage.completion_tokens == 40
