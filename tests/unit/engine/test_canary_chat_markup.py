"""The canary's chat-markup verdict as a pure function of recorded answers: tenant B's chat
message repeating a chat template's control string must count more than one prompt token a
copy (each copy spelled as text); exactly one a copy is the control token itself, and fails.
And the rule's ground, with SmolLM2's tokenizer: as text every control string the canary sends
takes at least two tokens a copy, as ChatML's control tokens exactly one."""

import asyncio

import httpx
import pytest

from kvfence_engine.canary.checks import check_chat_markup
from kvfence_engine.canary.config import CanaryConfig
from kvfence_engine.canary.observations import CHAT_CONTROLS, Answer
from kvfence_engine.canary.prompts import CONTROL_COPIES, CONTROL_STRINGS, chat_markup_content
from kvfence_engine.canary.target import TargetClient
from kvfence_engine.loading.chat_prompt import chat_prompt_ids
from kvfence_engine.loading.tokenizer_source import smollm2_tokenizer

PLAIN = 20  # prompt tokens of the message without control strings


def chat(control: str | None, prompt_tokens: int | None, status: int = 200) -> Answer:
    repeats = CONTROL_COPIES if control else None
    return Answer(
        "B", CHAT_CONTROLS, control or "plain", None, status, 0.05,
        usage_prompt_tokens=prompt_tokens, repeats=repeats,
        error_code=None if status == 200 else "invalid_request_error",
    )  # fmt: skip


def probed(**added: int) -> list[Answer]:
    """The plain message, and each control string adding `added` tokens (default 3 a copy)."""
    return [
        chat(None, PLAIN),
        *(chat(c, PLAIN + added.get(c, 3 * CONTROL_COPIES)) for c in CONTROL_STRINGS),
    ]


def test_control_strings_counted_as_text_pass() -> None:
    result = check_chat_markup(probed())
    assert result.passed, result.reason
    assert len(result.inputs["added_tokens"]) == len(CONTROL_STRINGS)


def test_a_control_string_counted_one_token_a_copy_fails_naming_it() -> None:
    result = check_chat_markup(probed(**{"<|im_start|>": CONTROL_COPIES}))
    assert not result.passed
    assert result.findings == [
        f"a chat message with {CONTROL_COPIES} copies of '<|im_start|>' counted "
        f"{CONTROL_COPIES} more prompt tokens than without them, at most one a copy: the control "
        "token; a tenant's message can then close its turn and open another"
    ]


def test_control_strings_dropped_from_the_message_fail() -> None:
    result = check_chat_markup(probed(**{"<|eot_id|>": 0}))
    assert not result.passed and "counted 0 more prompt tokens" in result.reason
    assert "none: dropped" in result.reason


def test_a_message_with_control_strings_refused_while_a_plain_one_is_answered_fails() -> None:
    answers = [chat(None, PLAIN), chat("<|im_end|>", None, status=400)]
    result = check_chat_markup(answers)
    assert not result.passed
    assert result.reason == (
        f"a chat message with {CONTROL_COPIES} copies of '<|im_end|>' got 400 "
        "invalid_request_error: chat content is text, to be answered"
    )


def test_a_target_that_answers_no_chat_passes_saying_so() -> None:
    """A model without a chat template: /v1/chat/completions is a 400, there is no turn."""
    result = check_chat_markup([chat(None, None, status=400), chat("<s>", None, status=400)])
    assert result.passed
    assert result.reason.startswith("the target answers no chat completions (400")


def test_nothing_to_judge_fails() -> None:
    assert not check_chat_markup([]).passed
    only_plain = check_chat_markup([chat(None, PLAIN)])
    assert not only_plain.passed and "no chat message with control strings" in only_plain.reason


def added_tokens(control: str, as_one_string: bool = False) -> int:
    """The prompt tokens `control`'s copies add to SmolLM2's chat prompt: with chat content as
    text, or (as_one_string) rendered and tokenized as one string, as before the fix."""
    tokenizer = smollm2_tokenizer()

    def count(content: str) -> int:
        messages = [{"role": "user", "content": content}]
        if as_one_string:
            return len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
        return len(chat_prompt_ids(tokenizer, messages))

    return count(chat_markup_content(control)) - count(chat_markup_content(None))


@pytest.mark.parametrize("control", CONTROL_STRINGS)
def test_as_text_each_control_string_takes_two_tokens_a_copy_as_chatml_control_one(
    control: str,
) -> None:
    assert added_tokens(control) >= 2 * CONTROL_COPIES
    if control in smollm2_tokenizer().control_strings:
        assert added_tokens(control, as_one_string=True) == CONTROL_COPIES
    else:
        assert added_tokens(control, as_one_string=True) == added_tokens(control)


def test_a_chat_probe_records_status_and_usage() -> None:
    def serve(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        body = {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 44}}
        return httpx.Response(200, json=body)

    target = TargetClient(CanaryConfig("http://t", "a", "b"))
    target.http = httpx.AsyncClient(transport=httpx.MockTransport(serve))
    chat_probe = target.chat("B", "hi", probe=CHAT_CONTROLS, context="<s>", repeats=8)
    answer = asyncio.run(chat_probe)
    assert (answer.status, answer.usage_prompt_tokens, answer.repeats) == (200, 44, 8)


def test_a_plain_chat_message_that_is_not_answered_for_another_reason_is_no_verdict() -> None:
    answers = [chat(None, None, status=429), chat("<s>", PLAIN + 24)]
    result = check_chat_markup(answers)
    assert not result.passed
    assert result.reason.startswith("the chat message without control strings got 429")
