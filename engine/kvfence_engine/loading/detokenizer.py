"""Incremental detokenization with OpenAI stop strings, in time linear in the answer.

Decoding the whole answer again for every token made each token cost more than the last (about
1 ms a token at 4,000 tokens, on the event loop). Here, as in Hugging Face TGI and vLLM, each
token decodes a short window only: the tokens read last time (context, for decoders that spell
a sequence's first token differently, such as SentencePiece's leading space) and the tokens
after them; the new text is what the window reads past its context. Text ending in U+FFFD may
be a character whose bytes are still arriving, so it is not read yet; where such a window grows
past `MAX_UNREAD` tokens (a model emitting broken bytes), it is read up to a token after which
nothing can change (`IncrementalText._safe_cut`), so even then every token costs the same.
Special tokens are skipped as `Tokenizer.decode` skips them, before they reach a window.

What comes out is the text `Tokenizer.decode` gives for the whole answer, for byte-level
tokenizers exactly (test_detokenizer.py, with SmolLM2's); a byte-fallback tokenizer's decoder
turns a run of byte tokens that ends invalid into U+FFFD as a whole, which no incremental
decoder can know before the run ends.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfence_engine.loading.tokenizer import Tokenizer

# Unread tokens past which a window still ending in U+FFFD is read up to a safe cut: more than
# one character's bytes (four), however they are split into tokens.
MAX_UNREAD = 16
# The cuts tried, counted back from the window's last token: a character left incomplete by
# one of them is completed or broken within the next four bytes.
_CUTS_TRIED = 4


@dataclass(slots=True)
class IncrementalText:
    """The text of a growing token sequence. The `stable` texts of every push, then the last
    push's `tail`, are the text of all its tokens."""

    tokenizer: Tokenizer
    window: list[int] = field(default_factory=list)  # the context's tokens, then the unread
    read: int = 0  # window[:read] is the context: its text has been read already

    def push(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """Add tokens; return (stable, tail): the new text no later token can change, and the
        text of the tokens after it as it reads now (an unfinished character as U+FFFD)."""
        special = self.tokenizer.special_ids
        self.window += [t for t in token_ids if t not in special]
        decode = self.tokenizer.decode
        context = decode(self.window[: self.read])
        text = decode(self.window)
        if len(text) > len(context) and not text.endswith("\ufffd"):
            self._read_up_to(len(self.window))
            return text[len(context) :], ""
        if len(self.window) - self.read > MAX_UNREAD:
            cut = self._safe_cut(text)
            if cut is not None:
                at, head, tail = cut
                self._read_up_to(at)
                return head[len(context) :], tail
        return "", text[len(context) :]

    def _read_up_to(self, end: int) -> None:
        """window[:end] is read: the tokens read this time become the next context."""
        del self.window[: self.read]
        self.read = end - self.read

    def _safe_cut(self, text: str) -> tuple[int, str, str] | None:
        """A cut among the last tokens of the window that splits its text in two, both sides
        read alone (the tail non-empty): then no byte of a character spans it, and the text
        before it is final whatever follows. Returns (where, the text before, the text
        after)."""
        decode = self.tokenizer.decode
        for at in range(len(self.window) - 1, len(self.window) - 1 - _CUTS_TRIED, -1):
            if at <= self.read:
                break
            head, tail = decode(self.window[:at]), decode(self.window[at:])
            if tail and head + tail == text:
                return at, head, tail
        return None


@dataclass(slots=True)
class Detokenizer:
    """An answer's text as it may be shown: no half characters, nothing that could still
    become a stop string, nothing after one."""

    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    stopped: bool = False
    emitted: int = 0  # characters of text already handed out
    text: IncrementalText = field(init=False)
    # The stable text from `kept_from` on: what is not handed out yet, and before it as much
    # handed-out text as the longest stop string, where a stop string the next tokens complete
    # may begin.
    kept: str = ""
    kept_from: int = 0

    def __post_init__(self) -> None:
        self.text = IncrementalText(self.tokenizer)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the new text that is safe to show. After a stop string, ''."""
        if self.stopped:
            return ""
        stable, tail = self.text.push(token_ids)
        self.kept += stable
        text, base = self.kept + tail, self.kept_from  # text[i] is character base + i
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s)) - base)
            if at != -1:
                self.stopped = True
                text = text[:at]
        end = len(text)
        if not (final or self.stopped):
            # the tail may end in a character whose bytes are still coming
            end = len(self.kept) + len(tail.rstrip("\ufffd"))
            if self.stop:
                end = min(end, len(text) - max(len(s) for s in self.stop) + 1)
        end += base
        if end <= self.emitted:
            return ""
        delta = text[self.emitted - base : end - base]
        self.emitted = end
        self._forget(max(len(s) for s in self.stop) if self.stop else 0)
        return delta

    def _forget(self, longest_stop: int) -> None:
        """Drop kept text no stop string can reach back to any more."""
        keep_from = min(max(0, self.emitted - longest_stop), self.kept_from + len(self.kept))
        if keep_from > self.kept_from:
            self.kept = self.kept[keep_from - self.kept_from :]
            self.kept_from = keep_from
