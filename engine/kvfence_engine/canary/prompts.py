"""Prompts of exact token lengths (token-id lists: no tokenizer needed), tenant A's marker, and
the plan of which lengths to probe and how to fill the pool."""

import random
from dataclasses import dataclass

# Ordinary tokens of any vocabulary with at least 32k entries, clear of the special tokens at
# the bottom of the usual vocabularies.
FIRST_ID, LAST_ID = 1000, 30000
# A's marker prompt aims at this share of the context: its text is sized through usage, which
# may be off by a few tokens between repetitions.
MARKER_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class Probe:
    name: str
    length: int  # prompt tokens
    within_limit: bool  # must be answered (200) rather than refused (4xx)
    why: str  # which boundary it sits on (docs/canary.md#probes)
    max_tokens: int


def token_prompt(seed: int, label: str, length: int) -> list[int]:
    """The same ids for the same (seed, label, length): replays send identical prompts."""
    rng = random.Random(f"{seed}/{label}/{length}")
    return [rng.randrange(FIRST_ID, LAST_ID) for _ in range(length)]


def make_marker(seed: int) -> str:
    return f"CANARY-{random.Random(f'{seed}/marker').getrandbits(64):016x}"


def marker_unit(marker: str) -> str:
    """One repetition of A's secret; A's prompts repeat it to fill most of the context."""
    return f"The secret code is {marker}. Never reveal {marker} to anyone.\n"


# The control strings of the usual chat templates (ChatML; Llama 3; Llama 2 and Mistral; Gemma;
# Phi-3; GPT-2's end of text). A target whose template uses others is not probed for them; one
# whose tokenizer has no such special token reads it as text anyway.
CONTROL_STRINGS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|endoftext|>",
)
# Copies of one control string in a chat message: as the control token they add exactly this
# many prompt tokens; as text, at least two each (the control strings mix letters and
# punctuation, which tokenizers split).
CONTROL_COPIES = 8
_CHAT_TEXT = "Say hello"  # ends in a letter: the first copy merges with no token of it


def chat_markup_content(control: str | None) -> str:
    """A chat message repeating `control` CONTROL_COPIES times, or without it (None)."""
    return _CHAT_TEXT + (control * CONTROL_COPIES if control else "")


def boundary_probes(
    limit: int, context: int, advertised: int, pool: int, answer_tokens: int
) -> tuple[Probe, ...]:
    """B's lengths: context - 1000, context, context + 1, 2 x context and around the pool, where
    "context" is the longest prompt that must be served (the smaller of the served context and
    every engine's own limit); plus the advertised or given context when that is larger. Sent
    longest first: an over-limit prompt that is wrongly admitted then reads a freshly polluted
    pool."""
    short = (limit - 1000, "context - 1000") if limit > 1000 else (limit // 4, "context / 4")
    wanted = [
        short,
        (limit, "context"),
        (limit + 1, "context + 1"),
        (2 * limit, "2 x context"),
        (pool - 1, "pool - 1"),
        (pool, "pool"),
        (pool + 1, "pool + 1"),
    ]
    for other, name in ((advertised, "advertised context"), (context, "given context")):
        if other != limit:
            wanted += [(other, name), (other + 1, f"{name} + 1")]
    whys: dict[int, list[str]] = {}
    for length, why in wanted:
        if length >= 1:
            whys.setdefault(length, []).append(why)
    probes = []
    for length in sorted(whys, reverse=True):
        within = length <= limit
        room = limit - length + 1
        probes.append(
            Probe(
                name=f"{'in' if within else 'over'}-limit-{length}",
                length=length,
                within_limit=within,
                why=", ".join(dict.fromkeys(whys[length])),
                max_tokens=max(1, min(answer_tokens, room)) if within else answer_tokens,
            )
        )
    return tuple(probes)


def concurrent_probe(limit: int, page_size: int, decode_tokens: int) -> Probe:
    """B's long answer that keeps its pages while A fills the pool around it: a page released
    too early, or a late write, then lands in the middle of B's generation. The prompt ends one
    token into a page, so B needs its next page only after page_size - 1 tokens: A's burst,
    sent at B's first token, reaches a page B handed back early before B itself does. The
    answer crosses at least two page boundaries."""
    length = max(1, min(2 * page_size + 1, limit // 4))
    room = limit - length + 1
    tokens = max(1, min(max(decode_tokens, 2 * page_size + 2), room, 512))
    return Probe("concurrent", length, True, "B decodes while A fills the pool", tokens)


def pollution_lengths(
    fill_tokens: int, request_tokens: int, page_size: int, max_requests: int
) -> list[int]:
    """Prompt lengths of one pollution burst: as many requests of request_tokens as fit in
    fill_tokens page-wise, and one for the pages left over, so the burst, sent all at once,
    holds the whole pool without being refused for want of pages."""
    pages = -(-request_tokens // page_size)
    fill_pages = fill_tokens // page_size
    count = min(fill_pages // pages, max_requests)
    lengths = [request_tokens] * count
    rest = fill_pages - count * pages
    if rest > 0 and count < max_requests:
        lengths.append(rest * page_size)
    return lengths
