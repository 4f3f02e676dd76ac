"""What the fuzz suites (tests/integration/test_fuzz_*.py) share: the processes' settings and
what every answer of the OpenAI surface must look like, whatever a client sent: never a 5xx,
every error in the OpenAI shape, every completion well-formed. The suites send one request at
a time, so not even a 503 `overloaded` is expected."""

import json
from typing import Any

# A short context keeps every generated completion short: a body without max_tokens runs to
# the end of the context.
FUZZ_CONTEXT = 64
FUZZ_KEY = "fuzz-key"  # the one tenant's API key at the fuzzed router
FUZZ_AUTH = {"Authorization": f"Bearer {FUZZ_KEY}"}
FUZZ_TOKEN = "fuzz-internal-token"  # the internal token of the fuzzed deployment's processes

ERROR_FIELDS = {"message", "type", "param", "code"}


def check_error_shape(status: int, body: Any) -> None:
    """`{"error": {"message", "type", "param", "code"}}`: message, type and code strings."""
    assert isinstance(body, dict) and set(body) == {"error"}, f"{status}: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS, f"{status}: {body!r}"
    assert all(isinstance(error[k], str) and error[k] for k in ("message", "type", "code")), body
    assert error["param"] is None or isinstance(error["param"], str), body


def _check_choice(choice: dict[str, Any], chat: bool, streamed: bool) -> None:
    assert choice["index"] == 0
    finishes = (None, "stop", "length") if streamed else ("stop", "length")
    assert choice["finish_reason"] in finishes, choice
    if chat:
        message = choice["delta"] if streamed else choice["message"]
        assert isinstance(message.get("content", ""), str), choice
    else:
        assert isinstance(choice["text"], str), choice


def check_completion(body: dict[str, Any], chat: bool) -> None:
    assert body["object"] == ("chat.completion" if chat else "text_completion"), body
    [choice] = body["choices"]
    _check_choice(choice, chat, streamed=False)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert usage["completion_tokens"] >= 0 and usage["prompt_tokens"] >= 1, usage


def check_stream(text: str, chat: bool) -> None:
    """SSE: `data: {chunk}` events, no error event, and `data: [DONE]` last."""
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.strip()]
    assert events and events[-1] == "[DONE]", text[-500:]
    finished = False
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, f"the stream ended with an error: {chunk}"
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion"), chunk
        for choice in chunk["choices"]:  # none in the usage chunk
            _check_choice(choice, chat, streamed=True)
            finished = finished or choice["finish_reason"] is not None
    assert finished, f"no chunk carried a finish_reason: {text[-500:]}"


def check_answer(path: str, status: int, media: str, content: bytes) -> None:
    """Any answer of the engine's or the router's HTTP API to anything a client sent; `media`
    is its Content-Type."""
    assert status < 500, f"{status} from {path}: {content[:500]!r}"
    if status >= 400:
        assert media.startswith("application/json"), f"{status} {media}: {content[:500]!r}"
        check_error_shape(status, json.loads(content))
        return
    if status != 200 or not path.endswith("completions"):
        return
    chat = path.endswith("chat/completions")
    if media.startswith("text/event-stream"):
        check_stream(content.decode(), chat)
    else:
        check_completion(json.loads(content), chat)
