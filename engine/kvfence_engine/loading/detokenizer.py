"""Incremental detokenization with OpenAI stop strings."""

from dataclasses import dataclass, field

from kvfence_engine.loading.tokenizer import Tokenizer


@dataclass(slots=True)
class Detokenizer:
    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of text already handed out
    stopped: bool = False

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the new text that is safe to show (no half characters, nothing
        that could still become a stop string). After a stop string, returns ''."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids)
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.stopped = True
                text = text[:at]
        end = len(text)
        if not (final or self.stopped):
            if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
                end = len(text.rstrip("\ufffd"))
            if self.stop:
                end = min(end, len(text) - max(len(s) for s in self.stop) + 1)
        if end <= self.emitted:
            return ""
        delta = text[self.emitted : end]
        self.emitted = end
        return delta
