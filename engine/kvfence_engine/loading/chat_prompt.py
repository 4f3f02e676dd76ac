"""A chat's prompt as token ids: the template's markup holds the control tokens, the messages'
content never does.

The tokenizer turns the text of a special token (ChatML's `<|im_start|>`, Llama 3's
`<|start_header_id|>`) into that token wherever it occurs, so a rendered chat tokenized as one
string lets a tenant's message close its turn and open a `system` or `assistant` one. Content
is text: wherever a message's content holds a control string, the content is rendered with a
fence character inside each such string (after its first character), so that only the
template's own markup still matches a special token when the rendered prompt is tokenized; the
runs of text between those tokens, the fences taken out, are tokenized with special tokens
spelled as text. The fence goes into the content before the template sees it, so a template
that trims or slices its content renders it as it would have without one.

Content without a control string (nearly every chat) is rendered and tokenized as one string,
as before.
"""

import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from kvfence_engine.loading.tokenizer import Tokenizer

# Where fence characters are looked for: the private use areas, which no tokenizer or template
# gives a meaning; a chat that uses every one of them is refused (ValueError).
_FENCE_CANDIDATES = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template applied to `messages` (role, content), as token ids."""
    strings = _fenceable(tokenizer.control_strings)
    if not any(s in m["content"] for m in messages for s in strings):
        return tokenizer.encode(tokenizer.apply_chat_template(messages))
    return fenced_chat_prompt_ids(tokenizer, messages)


def fenced_chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """chat_prompt_ids for content that holds control strings: the markup's special tokens,
    and the text between them tokenized as text."""
    controls = _control_pattern(_fenceable(tokenizer.control_strings))
    fence = _fence(tokenizer, messages)
    fenced = [m | {"content": _fence_controls(m["content"], controls, fence)} for m in messages]
    rendered = tokenizer.apply_chat_template(fenced)
    pieces = list(_split_at_special_tokens(tokenizer, rendered))
    texts = [piece.replace(fence, "") for piece in pieces if isinstance(piece, str)]
    encoded = iter(tokenizer.encode_text(texts))
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, str):
            ids += next(encoded)
        else:
            ids.append(piece)
    return ids


def _fenceable(control_strings: tuple[str, ...]) -> tuple[str, ...]:
    """The control strings a fence can break: a special token of one character is
    indistinguishable from text."""
    return tuple(s for s in control_strings if len(s) > 1)


@lru_cache(maxsize=8)
def _control_pattern(strings: tuple[str, ...]) -> re.Pattern[str] | None:
    """Where any of `strings` starts (a zero-width match, so that overlapping occurrences are
    all found); None for none."""
    if not strings:
        return None
    return re.compile(f"(?=(?:{'|'.join(map(re.escape, strings))}))")


def _fence_controls(content: str, controls: re.Pattern[str] | None, fence: str) -> str:
    """`content` with `fence` after the first character of every control string in it: no
    control string is left whole (the fence is in none of them), and none is made."""
    if controls is None:
        return content
    cuts = [m.start() + 1 for m in controls.finditer(content)]
    if not cuts:
        return content
    parts = [content[a:b] for a, b in zip([0, *cuts], [*cuts, len(content)], strict=True)]
    return fence.join(parts)


def _fence(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> str:
    """A character in none of the messages, the template and the special tokens' texts: every
    one in the rendered prompt is then a fence."""
    used = set(tokenizer.chat_template or "")
    used.update(*(m["content"] for m in messages), *tokenizer.control_strings)
    for candidates in _FENCE_CANDIDATES:
        for code in candidates:
            if chr(code) not in used:
                return chr(code)
    raise ValueError("the messages use every private-use character; kvfence needs one unused")


def _split_at_special_tokens(tokenizer: Tokenizer, rendered: str) -> Iterator[str | int]:
    """The rendered prompt as runs of text and the special tokens between them, found by the
    tokenizer itself (so its rules for special tokens, such as stripping the spaces around
    one, hold)."""
    encoding = tokenizer.backend.encode_batch([rendered], add_special_tokens=False)[0]
    start = 0
    for token_id, (begin, end) in zip(encoding.ids, encoding.offsets, strict=True):
        if token_id in tokenizer.special_ids:
            if begin > start:
                yield rendered[start:begin]
            yield token_id
            start = end
    if start < len(rendered):
        yield rendered[start:]
