"""Hostile request bodies: every field has the range the engine's arithmetic supports, a field
the API does not know (a typo) or does not implement (OpenAI's `tools`) is refused by name,
every refusal is a 400 in the OpenAI shape from the engine and the router alike, and anything
unexpected is a JSON 500 that names no internals."""

import json
import logging
import re
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel

from helpers.engines import generate, make_tiny_engine, prompt_of, run_until_done, submit
from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.request import MIN_TEMPERATURE, SamplingParams
from kvfence_engine.core.sampler import sample
from kvfence_engine.loading.tokenizer import Tokenizer
from kvfence_engine.loading.tokenizer_source import TINY_RANDOM, load_tokenizer
from kvfence_engine.router.app import create_router_app
from kvfence_engine.router.backends import Backends
from kvfence_engine.router.state import RouterState
from kvfence_engine.serving.app import create_app
from kvfence_engine.serving.async_engine import AsyncEngine
from kvfence_engine.serving.openai_api import new_app
from kvfence_engine.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    TextPart,
)
from kvfence_engine.serving.state import ServerState

PAGES = 64
SEED_MAX = 2**64 - 1
SEED_MIN = -(2**63)

# --- the sampler ----------------------------------------------------------------------------


def _params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=1, **kwargs)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38, 1e-8, MIN_TEMPERATURE / 2])
def test_a_temperature_below_the_floor_is_greedy(temperature: float) -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 10
    generators: list[torch.Generator | None] = [torch.Generator().manual_seed(i) for i in range(3)]
    tokens, _ = sample(logits, [_params(temperature=temperature, seed=1)] * 3, generators)
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("scale", [1.0, 1e3, 1e30, 3e38])
def test_a_temperature_just_above_the_floor_never_overflows_into_nan(scale: float) -> None:
    """logits / t would be +inf for large logits (then softmax is NaN and multinomial raises);
    shifted by the largest logit first, the distribution is one-hot on the top token."""
    logits = torch.tensor([[0.5, -1.0, 1.0, -0.25]]) * scale
    tokens, _ = sample(logits, [_params(temperature=2 * MIN_TEMPERATURE)], [torch.Generator()])
    assert tokens == [2]


def test_sampling_near_the_floor_still_chooses_between_near_ties() -> None:
    """Above the floor it is still sampling: two logits within a hair of each other both come
    up (a greedy floor set too high would always pick the first)."""
    logits = torch.tensor([[3.0, 3.0 + 1e-6, -5.0]])
    generator = torch.Generator().manual_seed(0)
    picks = {
        sample(logits, [_params(temperature=2 * MIN_TEMPERATURE)], [generator])[0][0]
        for _ in range(64)
    }
    assert picks == {0, 1}


def test_logits_that_are_not_finite_fail_with_a_clear_error_not_inside_multinomial() -> None:
    logits = torch.tensor([[1.0, float("nan"), 0.0]])
    with pytest.raises(ValueError, match="not finite"):
        sample(logits, [_params(temperature=1.0)], [torch.Generator()])


def test_more_top_logprobs_than_the_vocabulary_returns_the_whole_vocabulary() -> None:
    logits = torch.randn(1, 5)
    _, logprobs = sample(logits, [_params(logprobs=20)], [None])
    assert logprobs[0] is not None and len(logprobs[0].top) == 5


# --- the engine -----------------------------------------------------------------------------


def test_a_tiny_temperature_among_other_requests_is_served_greedily_and_leaks_nothing() -> None:
    """The incident: temperature 1e-300 raised inside the prefill step, failed everyone in
    flight and leaked the batch's pages. Now it is greedy, and everyone is served."""
    engine = make_tiny_engine(pages=PAGES)
    others = [submit(engine, prompt_of(20, seed=i), 8, ignore_eos=True) for i in range(3)]
    hostile = submit(engine, prompt_of(20, seed=7), 8, ignore_eos=True, temperature=1e-300)
    run_until_done(engine)
    assert [seq.finish_reason for seq in (*others, hostile)] == ["length"] * 4
    greedy = generate(make_tiny_engine(), prompt_of(20, seed=7), 8, ignore_eos=True)
    assert hostile.output_ids == greedy.output_ids
    assert engine.pages.num_free == PAGES


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, SEED_MAX])
def test_every_64_bit_seed_is_served(seed: int) -> None:
    seq = generate(make_tiny_engine(), prompt_of(6), 4, temperature=1.0, seed=seed)
    assert seq.finish_reason in ("length", "stop")


# --- the HTTP surface of the engine and of the router ---------------------------------------


@pytest.fixture(scope="module")
def engine_app() -> Iterator[tuple[TestClient, LLMEngine]]:
    llm = make_tiny_engine(pages=PAGES)
    engine = AsyncEngine(llm)
    engine.start()
    try:
        with TestClient(create_app(ServerState(engine=engine))) as client:
            yield client, llm
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def router_app() -> Iterator[TestClient]:
    """A router with no reachable backend: what it refuses, it refuses before calling one."""
    name, tokenizer = load_tokenizer(TINY_RANDOM)
    backends = Backends.create(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], None)
    state = RouterState(name, tokenizer, backends, None, None, 512)
    with TestClient(create_router_app(state)) as client:
        yield client


def post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    """JSON with \\u escapes (what a client may send: a lone surrogate is valid JSON)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONE = "\ud800"
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
JSON_MODE = {"type": "json_object"}
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    (COMPLETIONS, {"prompt": "hi", "seed": SEED_MAX + 1}, "seed"),
    (COMPLETIONS, {"prompt": "hi", "seed": SEED_MIN - 1}, "seed"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, "seed"),
    (COMPLETIONS, {"prompt": f"tenant {LONE} text"}, "prompt"),
    (COMPLETIONS, {"prompt": [f"x{LONE}"]}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["ok", "\udfff"]}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "user": LONE}, "user"),
    (CHAT, {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": f"a{LONE}"}]}]},
        "messages[0].content",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": LONE}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1e-300}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    # a field the API does not know, at any depth: a typo is never ignored (issue 34, item 6)
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokns": 2}, "max_tokns"),
    (COMPLETIONS, {"prompt": "hi", "max_tokns": 2}, "max_tokns"),
    (CHAT, {"messages": [{"role": "user", "contnet": "hi"}]}, "messages[0].contnet"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
        "messages[0].content[0].x",
    ),
    (
        COMPLETIONS,
        {"prompt": "hi", "stream": True, "stream_options": {"include_usag": True}},
        "stream_options.include_usag",
    ),
    # a field OpenAI defines and kvfence does not implement: refused by name, never ignored
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}, "tools"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "response_format": JSON_MODE},
        "response_format",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages[0].name"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 100}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of"),
    (
        COMPLETIONS,
        {"prompt": "hi", "stream": True, "stream_options": {"include_obfuscation": True}},
        "stream_options.include_obfuscation",
    ),
]


def _is_invalid_request(r: Any, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE)
def test_the_engine_refuses_out_of_range_fields_and_broken_text_with_a_400(
    engine_app: tuple[TestClient, LLMEngine], path: str, body: dict[str, Any], param: str
) -> None:
    client, llm = engine_app
    _is_invalid_request(post(client, path, body | {"max_tokens": body.get("max_tokens", 2)}), param)
    assert llm.pages.num_free == PAGES


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE)
def test_the_router_refuses_them_with_the_same_400(
    router_app: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    _is_invalid_request(post(router_app, path, body), param)


def test_an_unrecognised_field_is_refused_in_openai_words(
    engine_app: tuple[TestClient, LLMEngine], router_app: TestClient
) -> None:
    """A typo of max_tokens would otherwise generate to the end of the context."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokns": 2}
    for client in (engine_app[0], router_app):
        error = post(client, CHAT, body).json()["error"]
        assert (error["message"], error["param"], error["code"]) == (
            "max_tokns: Unrecognized request argument supplied: max_tokns",
            "max_tokns",
            "invalid_request",
        )


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        (CHAT, {"tools": [TOOL]}, "tools: kvfence does not implement tool calling"),
        (
            CHAT,
            {"response_format": JSON_MODE},
            "response_format: kvfence does not implement structured output",
        ),
        (
            COMPLETIONS,
            {"best_of": 3},
            "best_of: kvfence does not implement the best of several completions",
        ),
    ],
)
def test_a_field_openai_defines_and_kvfence_does_not_implement_says_so(
    engine_app: tuple[TestClient, LLMEngine],
    router_app: TestClient,
    path: str,
    body: dict[str, Any],
    says: str,
) -> None:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    for client in (engine_app[0], router_app):
        message = post(client, path, prompt | body).json()["error"]["message"]
        assert message.startswith(says), message


def test_an_unimplemented_field_sent_as_null_or_as_what_kvfence_does_is_served(
    engine_app: tuple[TestClient, LLMEngine],
) -> None:
    """null is OpenAI's "not given"; `store: false` and `include_obfuscation: false` ask for
    what kvfence does anyway (SDKs that serialise every field send these)."""
    client, llm = engine_app
    body = {
        "messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": None}],
        "max_tokens": 2,
        "tools": None,
        "tool_choice": None,
        "response_format": None,
        "logit_bias": None,
        "store": False,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    r = post(client, CHAT, body)
    assert r.status_code == 200, r.text
    assert r.text.endswith("data: [DONE]\n\n")
    r = post(client, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": None})
    assert r.status_code == 200, r.text
    assert llm.pages.num_free == PAGES


def _fields_of(*typed_dicts: type) -> set[str]:
    return {name for cls in typed_dicts for name in typing.get_type_hints(cls)}


def test_every_field_the_openai_client_can_send_is_served_or_refused_by_name() -> None:
    """Each request field of the installed `openai` client is a field of kvfence's models
    (served, or declared as not implemented so that its refusal names what it asks for), not
    an unrecognised one: a newer client's new field fails here first."""
    from openai.types import completion_create_params as completion
    from openai.types.chat import (
        chat_completion_assistant_message_param as assistant,
    )
    from openai.types.chat import (
        chat_completion_content_part_text_param as text_part,
    )
    from openai.types.chat import (
        chat_completion_developer_message_param as developer,
    )
    from openai.types.chat import (
        chat_completion_stream_options_param as stream_options,
    )
    from openai.types.chat import (
        chat_completion_system_message_param as system,
    )
    from openai.types.chat import (
        chat_completion_tool_message_param as tool,
    )
    from openai.types.chat import (
        chat_completion_user_message_param as user,
    )
    from openai.types.chat import completion_create_params as chat

    pairs: list[tuple[set[str], type[BaseModel]]] = [
        (_fields_of(chat.CompletionCreateParamsStreaming), ChatCompletionRequest),
        (_fields_of(completion.CompletionCreateParamsStreaming), CompletionRequest),
        (
            _fields_of(
                system.ChatCompletionSystemMessageParam,
                developer.ChatCompletionDeveloperMessageParam,
                user.ChatCompletionUserMessageParam,
                assistant.ChatCompletionAssistantMessageParam,
                tool.ChatCompletionToolMessageParam,
            ),
            ChatMessage,
        ),
        (_fields_of(text_part.ChatCompletionContentPartTextParam), TextPart),
        (_fields_of(stream_options.ChatCompletionStreamOptionsParam), StreamOptions),
    ]
    for openai_fields, model in pairs:
        assert openai_fields - set(model.model_fields) == set(), model.__name__


def test_a_lone_surrogate_error_says_where_it_is() -> None:
    name, tokenizer = load_tokenizer(TINY_RANDOM)
    backends = Backends.create(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], None)
    with TestClient(create_router_app(RouterState(name, tokenizer, backends, None, None))) as c:
        r = post(c, COMPLETIONS, {"prompt": f"ab{LONE}"})
    assert "lone surrogate U+D800 at character 2" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": SEED_MAX},
        {"seed": SEED_MIN},
        {"temperature": 1e-300},
        {"temperature": 2.0, "top_p": 1e-9, "top_k": 10**30},
        {"prompt": "emoji \ud83d\ude00 as a surrogate pair is fine"},
        {"stop": "\ud83d\ude00"},
    ],
)
def test_the_edges_of_each_range_are_served(
    engine_app: tuple[TestClient, LLMEngine], fields: dict[str, Any]
) -> None:
    client, llm = engine_app
    r = post(client, COMPLETIONS, {"prompt": "Tenant isolation", "max_tokens": 3} | fields)
    assert r.status_code == 200, r.text
    assert llm.pages.num_free == PAGES


def test_a_temperature_below_the_floor_answers_like_temperature_zero(
    engine_app: tuple[TestClient, LLMEngine],
) -> None:
    client, _ = engine_app
    body = {"prompt": "Tenant isolation", "max_tokens": 8, "ignore_eos": True}
    texts = [
        post(client, COMPLETIONS, body | {"temperature": t}).json()["choices"][0]["text"]
        for t in (0.0, 1e-300, MIN_TEMPERATURE / 2)
    ]
    assert texts[0] == texts[1] == texts[2]


# --- the catch-all --------------------------------------------------------------------------

SECRET = "backend http://10.1.2.3:8001 said: KeyError('tenant-b')"


def _crashing_app() -> FastAPI:
    app = new_app("test")

    @app.get("/crash")
    async def crash() -> None:
        raise RuntimeError(SECRET)

    @app.get("/crash-mid-stream")
    async def crash_mid_stream() -> StreamingResponse:
        async def body() -> Iterator[str]:  # type: ignore[misc]
            yield "data: one\n\n"
            raise RuntimeError(SECRET)

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def _is_internal_error_naming_nothing(r: Any) -> str:
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "server_error",
        "internal_error",
        None,
    )
    match = re.fullmatch(r"internal error \(request id ([0-9a-f]{16})\)", error["message"])
    assert match, error["message"]
    assert "10.1.2.3" not in r.text and "KeyError" not in r.text
    return match.group(1)


def test_an_unexpected_exception_is_a_json_500_naming_only_a_request_id_that_the_log_has(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        caplog.at_level(logging.ERROR),
        TestClient(_crashing_app(), raise_server_exceptions=False) as client,
    ):
        request_id = _is_internal_error_naming_nothing(client.get("/crash"))
        ok = client.get("/healthz")
    assert ok.status_code == 200  # and the app goes on
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert len(logged) == 1 and "GET /crash" in logged[0].getMessage()
    assert logged[0].exc_info is not None and SECRET in str(logged[0].exc_info[1])


def test_an_exception_after_the_headers_breaks_the_connection_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing can be answered any more; ending the body cleanly would pass a truncated
    stream off as complete."""
    with (
        caplog.at_level(logging.ERROR),
        TestClient(_crashing_app()) as client,
        pytest.raises(RuntimeError, match="said"),
    ):
        client.get("/crash-mid-stream")
    assert any("after its response started" in rec.getMessage() for rec in caplog.records)


def test_the_engine_answers_a_crash_in_its_own_handler_with_a_json_500(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = make_tiny_engine(pages=PAGES)
    engine = AsyncEngine(llm)
    engine.start()

    def broken_encode(_self: Tokenizer, _text: str) -> list[int]:
        raise TypeError(SECRET)

    try:
        with TestClient(
            create_app(ServerState(engine=engine)), raise_server_exceptions=False
        ) as client:
            monkeypatch.setattr(Tokenizer, "encode_prompt", broken_encode)
            _is_internal_error_naming_nothing(post(client, COMPLETIONS, {"prompt": "hi"}))
            monkeypatch.undo()
            assert post(client, COMPLETIONS, {"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        engine.stop()
    assert llm.pages.num_free == PAGES


def test_the_router_answers_a_crash_in_its_own_handler_with_a_json_500(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name, tokenizer = load_tokenizer(TINY_RANDOM)
    backends = Backends.create(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], None)
    state = RouterState(name, tokenizer, backends, None, None, 512)

    def broken_encode(_self: Tokenizer, _text: str) -> list[int]:
        raise TypeError(SECRET)

    monkeypatch.setattr(Tokenizer, "encode_prompt", broken_encode)
    with TestClient(create_router_app(state), raise_server_exceptions=False) as client:
        _is_internal_error_naming_nothing(post(client, COMPLETIONS, {"prompt": "hi"}))
