"""What an OpenAI client sees from the engine (combined role) and the router: ids shaped like
OpenAI's, 404 model_not_found for a model the server does not serve, `param` naming the field
the client sent, and a malformed body explained in words. Real processes, the `openai` client
where it can send the request, raw HTTP where it cannot (a body that is not JSON)."""

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from helpers.deployments import Deployment
from helpers.fuzzing import FUZZ_AUTH, FUZZ_CONTEXT, FUZZ_KEY
from kvfence_engine.tools.localproc import LocalProcess

MODEL = "tiny-random"  # what a tiny-random engine serves, and the router in front of it
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]


@pytest.fixture(params=["engine", "router"])
def front(
    request: pytest.FixtureRequest, fuzz_server: LocalProcess, fuzz_deployment: Deployment
) -> Iterator[tuple[str, dict[str, str]]]:
    """The URL and auth headers of a combined engine, then of a router with API keys."""
    if request.param == "engine":
        yield fuzz_server.url, {}
    else:
        yield fuzz_deployment.router.url, FUZZ_AUTH


def client_of(front: tuple[str, dict[str, str]]) -> openai.OpenAI:
    url, headers = front
    return openai.OpenAI(
        base_url=url + "/v1", api_key=FUZZ_KEY if headers else "unused", max_retries=0
    )


def test_ids_carry_openai_prefixes_and_a_stream_shares_one(front: tuple[str, dict[str, str]]):
    client = client_of(front)
    completion = client.completions.create(model=MODEL, prompt="a b", max_tokens=2)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert completion.id.startswith("cmpl-") and chat.id.startswith("chatcmpl-")
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True)
    )
    assert len(chunks) >= 2 and {c.id for c in chunks} == {chunks[0].id}
    assert chunks[0].id.startswith("chatcmpl-") and chunks[0].id != chat.id
    text_chunks = list(
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, stream=True)
    )
    assert {c.id for c in text_chunks} == {text_chunks[0].id}
    assert text_chunks[0].id.startswith("cmpl-")


def test_a_model_it_does_not_serve_is_404_model_not_found(front: tuple[str, dict[str, str]]):
    client = client_of(front)
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as chat_refused:
        client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as completion_refused:
        client.completions.create(model="gpt-4", prompt="a", max_tokens=2)
    for refused in (chat_refused, completion_refused):
        error = refused.value.body
        assert isinstance(error, dict)
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            "model",
            "model_not_found",
        )
        assert "`gpt-4` does not exist" in error["message"] and MODEL in error["message"]


def test_an_over_long_prompt_names_the_field_it_was_sent_in(front: tuple[str, dict[str, str]]):
    """Token ids are counted exactly at admission, which sees no field names: the API layer
    names `prompt` for a completion and `messages` for a chat."""
    client = client_of(front)
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=MODEL, prompt=[5] * (FUZZ_CONTEXT + 1), max_tokens=1)
    long_chat: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "hello " * FUZZ_CONTEXT}
    ]
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=1)
    for refused, param in ((completion, "prompt"), (chat, "messages")):
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["code"] == "context_length_exceeded"
        assert refused.value.body["param"] == param


def test_a_misspelt_or_unimplemented_field_is_a_400_naming_it(front: tuple[str, dict[str, str]]):
    """A typo is not ignored (it would generate to the end of the context), nor is a field
    OpenAI defines that kvfence does not implement (tools, JSON mode)."""
    client = client_of(front)
    with pytest.raises(openai.BadRequestError) as typo:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"max_tokns": 2})
    with pytest.raises(openai.BadRequestError) as json_mode:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, response_format={"type": "json_object"}
        )
    with pytest.raises(openai.BadRequestError) as tools:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"tools": []})
    for refused, param, says in (
        (typo, "max_tokns", "Unrecognized request argument supplied: max_tokns"),
        (json_mode, "response_format", "kvfence does not implement structured output"),
        (tools, "tools", "Unrecognized request argument supplied: tools"),  # chat's, not here
    ):
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == param and says in error["message"]


def test_a_body_that_is_not_json_is_explained_in_words(front: tuple[str, dict[str, str]]):
    url, headers = front
    r = httpx.post(
        url + "/v1/completions",
        content=b'{"prompt": "a" "max_tokens": 2}',
        headers=headers | {"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "request body is not valid JSON: Expecting ',' delimiter at line 1 column 16",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_request",
    }


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        (
            "/v1/completions",
            b"[1, 2]",
            "request body is not a JSON object: send a JSON object",
            None,
        ),
        ("/v1/completions", b"", "request body is missing: send a JSON object", None),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user"}, {"role": "robot"}]}',
            "messages[1].role: Input should be 'system', 'developer', 'user', 'assistant' or "
            "'tool'",
            "messages[1].role",
        ),
        (
            "/v1/completions",
            b'{"prompt": 7}',
            "prompt: Input should be a valid string, or Input should be a valid list",
            "prompt",
        ),
    ],
)
def test_an_invalid_body_names_the_field_as_the_client_wrote_it(
    front: tuple[str, dict[str, str]], path: str, body: bytes, message: str, param: str | None
):
    url, headers = front
    r = httpx.post(url + path, content=body, headers=headers | {"content-type": "application/json"})
    assert r.status_code == 400
    assert (r.json()["error"]["message"], r.json()["error"]["param"]) == (message, param)


def test_a_json_body_sent_as_another_content_type_is_told_to_send_json(
    front: tuple[str, dict[str, str]],
):
    url, headers = front
    r = httpx.post(
        url + "/v1/completions",
        content=b'{"prompt": "a", "max_tokens": 2}',
        headers=headers | {"content-type": "text/plain; charset=utf-8"},
    )
    assert r.status_code == 400
    assert (r.json()["error"]["message"], r.json()["error"]["param"]) == (
        "request body is sent as text/plain: send a JSON object as application/json",
        None,
    )
