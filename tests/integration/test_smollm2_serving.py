"""The real model behind the real server, through the official openai client."""

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from kvfence_engine.loading.tokenizer_source import smollm2_gguf_path
from kvfence_engine.tools.localproc import LocalProcess

pytestmark = pytest.mark.slow
ASKED = {"role": "user", "content": "What is the capital of France?"}
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": ASKED["content"]}]


@pytest.fixture(scope="module")
def client(smollm2_server: LocalProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0)


def test_greedy_chat_knows_the_capital_of_france(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0
    )
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason == "stop"


def test_streaming_chat_delivers_the_same_answer(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 3  # really streamed, not one blob
    assert "Paris" in "".join(pieces)


def test_usage_counts_prompt_tokens_like_the_reference_tokenizer(client: openai.OpenAI) -> None:
    import transformers  # the reference tokenizer (test extra)

    path = smollm2_gguf_path()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = reference.apply_chat_template([ASKED], add_generation_prompt=True, tokenize=False)
    expected = reference.encode(text, add_special_tokens=False)
    r = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=3
    )
    assert r.usage is not None and r.usage.prompt_tokens == len(expected)


def test_by_default_it_serves_the_files_weights_as_measured_fastest_here(
    smollm2_server: LocalProcess,
) -> None:
    """--weight-dtype auto on CPU: the Q4_1 file's blocks kept (int4), or kept with their
    dequantization as float16 for batches past a few rows (int4+float16), whichever measured
    faster on this CPU at start, and why (still Paris, above)."""
    pool = httpx.get(smollm2_server.url + "/v1/kvpool").json()
    assert pool["weight_dtype"] in ("int4", "int4+float16") and pool["kv_dtype"] == "float32"
    said = pool["weight_choice"]
    assert said.startswith(f"auto chose {pool['weight_dtype']} by measurement on this CPU"), said
    assert "int4: decode 1 row" in said and "int4+float16: decode 1 row" in said
    assert smollm2_server.log_path is not None  # and the start-up log says the same
    assert said in smollm2_server.log_path.read_text()
