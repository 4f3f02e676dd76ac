"""Hypothesis over the sampling parameters, through the HTTP API of a real engine process and of
a real router + prefill + decode: temperature (tiny, huge, subnormal, negative zero, NaN),
top_p, top_k, seed (64-bit edges), max_tokens, logprobs, stop, ignore_eos, n, stream.

Each example is a request with at most one field out of its range (an oracle knows which): a
request with none is answered 200 with a well-formed completion (seeded: the same text when
sent again), one with a broken field gets a 400 in the OpenAI shape naming that field; never a
5xx, and no KV page leaked (the autouse pool-whole check). Bounded for CI: a fixed number of
examples, derandomized.
"""

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.deployments import Deployment
from helpers.fuzzing import FUZZ_AUTH, check_answer
from kvfence_engine.loading.loader import TINY_CONFIG
from kvfence_engine.tools.localproc import LocalProcess

EXAMPLES = 120
BOUNDED = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,  # a seeded example sends its request twice; the client's timeout bounds it
    database=None,
    suppress_health_check=list(HealthCheck),
)
VOCAB = TINY_CONFIG.vocab_size
NAN, INF = float("nan"), float("inf")
LONE = "\ud800"
SEEDS = st.integers(-(2**63), 2**64 - 1)  # what torch.Generator takes
NOT_A_NUMBER = st.sampled_from(["warm", [], {"x": 1}])

words = st.text(alphabet="abcdefghij klmnop", min_size=1, max_size=12)


def edges_or(values: list[Any], general: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(values), general)


# field -> (values in its range, values out of it)
SAMPLING: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "temperature": (
        edges_or(
            [0.0, -0.0, 5e-324, 1e-300, 1e-45, 1e-38, 9.99e-6, 1e-5, 1.00001e-5, 0.7, 2.0],
            st.floats(min_value=0.0, max_value=2.0),
        ),
        edges_or(
            [-5e-324, -1e-300, 2.0000001, 1e308, NAN, INF, -INF],
            st.one_of(st.floats(max_value=-1e-300), st.floats(min_value=2.0000001), NOT_A_NUMBER),
        ),
    ),
    "top_p": (
        edges_or([5e-324, 1e-300, 1e-8, 0.5, 1.0], st.floats(0.0, 1.0, exclude_min=True)),
        edges_or([0.0, -0.0, -1e-300, 1.0000001, NAN, INF], NOT_A_NUMBER),
    ),
    "top_k": (
        edges_or([0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**63, 2**64], st.integers(0)),
        edges_or([-1, -(2**63)], st.one_of(st.integers(max_value=-1), NOT_A_NUMBER)),
    ),
    "seed": (
        edges_or([0, -1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)], SEEDS),
        edges_or(
            [2**64, -(2**63) - 1, 2**128],
            st.one_of(st.integers(min_value=2**64), st.integers(max_value=-(2**63) - 1)),
        ),
    ),
    "max_tokens": (
        edges_or([1, 2, 63, 64, 65, 2**31, 2**63, 2**64, None], st.integers(1)),
        edges_or([0, -1, -(2**63)], st.one_of(st.integers(max_value=0), NOT_A_NUMBER)),
    ),
    "stop": (
        st.one_of(st.none(), words, st.lists(words, max_size=4)),
        st.sampled_from(["", ["a", ""], LONE, [f"x{LONE}"], ["a", "b", "c", "d", "e"], 7]),
    ),
    "ignore_eos": (st.booleans(), st.sampled_from([[], {"x": 1}, "maybe"])),
    "n": (st.just(1), st.sampled_from([0, 2, -1, 2**64])),
    "stream": (st.booleans(), st.sampled_from([[], {"x": 1}, "maybe"])),
}
COMPLETION = SAMPLING | {
    "prompt": (
        st.one_of(words, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)),
        st.sampled_from(["", [], [VOCAB], [-1], [2**64], [1, "a"], f"a{LONE}", None, 3]),
    ),
    "logprobs": (
        st.one_of(st.none(), st.integers(0, 20)),
        st.one_of(st.integers(min_value=21), st.integers(max_value=-1), NOT_A_NUMBER),
    ),
}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": words})
CHAT = SAMPLING | {
    "messages": (
        st.lists(MESSAGE, min_size=1, max_size=2),
        st.sampled_from(
            [[], [{"role": "robot", "content": "hi"}], [{"role": "user", "content": LONE}], "hi"]
        ),
    ),
    "logprobs": (st.booleans(), st.sampled_from([[], {"x": 1}, "maybe"])),
    "top_logprobs": (
        st.one_of(st.none(), st.integers(0, 20)),
        st.one_of(st.integers(min_value=21), st.integers(max_value=-1)),
    ),
    "max_completion_tokens": SAMPLING["max_tokens"],
}
REQUIRED = {"prompt", "messages"}


@dataclass(frozen=True)
class Example:
    path: str
    body: dict[str, Any]
    broken: str | None  # the one field out of its range, if any


@st.composite
def examples(draw: st.DrawFn) -> Example:
    chat = draw(st.booleans())
    fields = CHAT if chat else COMPLETION
    broken = draw(st.one_of(st.none(), st.sampled_from(sorted(fields))))
    body = {}
    for name, (valid, invalid) in fields.items():
        if name == broken:
            body[name] = draw(invalid)
        elif name in REQUIRED or draw(st.booleans()):
            body[name] = draw(valid)
    return Example("/v1/chat/completions" if chat else "/v1/completions", body, broken)


def send(url: str, example: Example, headers: dict[str, str]) -> httpx.Response:
    content = json.dumps(example.body)  # NaN and Infinity as Python writes them; \\ud800 escaped
    headers = headers | {"content-type": "application/json"}
    return httpx.post(url + example.path, content=content, headers=headers, timeout=60)


def check_logprobs(choice: dict[str, Any], chat: bool, top: int) -> None:
    logprobs = choice["logprobs"]
    if chat:
        items = logprobs["content"] if logprobs else []
        values = [i["logprob"] for i in items] + [
            t["logprob"] for i in items for t in i["top_logprobs"]
        ]
        assert all(len(i["top_logprobs"]) <= top for i in items), logprobs
    else:
        items = logprobs["top_logprobs"] if logprobs else []
        values = list(logprobs["token_logprobs"] if logprobs else []) + [
            v for entry in items for v in entry.values()
        ]
        assert all(len(entry) <= top for entry in items), logprobs
    assert all(math.isfinite(v) and v <= 1e-4 for v in values), logprobs


def check_example(url: str, example: Example, headers: dict[str, str]) -> None:
    try:
        check_answered(url, example, headers)
    except AssertionError as exc:
        exc.add_note(f"{example.path} {example.body!r}, broken: {example.broken}")
        raise


def check_answered(url: str, example: Example, headers: dict[str, str]) -> None:
    r = send(url, example, headers)
    check_answer(example.path, r.status_code, r.headers.get("content-type", ""), r.content)
    if example.broken is not None:
        assert r.status_code == 400, f"{example.broken} out of range, yet {r.status_code}"
        param = r.json()["error"]["param"] or ""
        assert re.split(r"[.\[]", param)[0] == example.broken, r.json()  # messages[0].role
        return
    assert r.status_code == 200, r.text
    body, chat = example.body, example.path.endswith("chat/completions")
    if body.get("stream"):
        return  # check_answer read the whole stream
    answer = r.json()
    if chat:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
    else:
        limit = body.get("max_tokens", 16)
    if limit is not None:
        assert answer["usage"]["completion_tokens"] <= limit, answer["usage"]
    wants_logprobs = body.get("logprobs") if chat else body.get("logprobs") is not None
    if wants_logprobs:
        top = (body.get("top_logprobs") or 0) if chat else body["logprobs"]
        check_logprobs(answer["choices"][0], chat, top)
    if body.get("seed") is not None:
        again = send(url, example, headers)
        assert again.status_code == 200, again.text
        assert again.json()["choices"] == answer["choices"], "same seed, another answer"


@BOUNDED
@given(example=examples())
def answers_every_example(url: str, headers: dict[str, str], example: Example) -> None:
    """One function for both targets: derandomized, both get the same examples."""
    check_example(url, example, headers)


def test_the_engine_answers_any_sampling_parameters_with_a_completion_or_a_400_naming_them(
    fuzz_server: LocalProcess,
) -> None:
    answers_every_example(fuzz_server.url, {})


def test_the_router_answers_any_sampling_parameters_with_a_completion_or_a_400_naming_them(
    fuzz_deployment: Deployment,
) -> None:
    answers_every_example(fuzz_deployment.router.url, FUZZ_AUTH)


def test_an_empty_prompt_through_the_router_is_a_400_naming_the_prompt(
    fuzz_deployment: Deployment,
) -> None:
    """It named an internal field (`prompt_ids`) and quoted pydantic's message."""
    example = Example("/v1/completions", {"prompt": ""}, "prompt")
    r = send(fuzz_deployment.router.url, example, FUZZ_AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": "the prompt is empty",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "invalid_request",
    }
