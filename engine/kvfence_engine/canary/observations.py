"""What the canary saw: one record per completion request. The checks are pure functions of
these records, so every verdict can be re-derived from the report."""

from dataclasses import dataclass, field
from typing import Any

TENANT_A = "A"
TENANT_B = "B"

# Probe names of requests that are not boundary probes.
CALIBRATION = "calibration"
MARKER_SIZING = "marker-sizing"
POLLUTION_MARKER = "pollution-marker"  # A's text prompts carrying the marker
POLLUTION_FILL = "pollution-fill"  # A's token-id prompts (the rest of an A burst, or neutral)
PREFIX_OWNER = "prefix-owner"  # A's prompt sent cold, then repeated: A's own cache hit
PREFIX_INTRUDER = "prefix-intruder"  # B sending A's exact prompt: must never hit A's pages
# B's chat messages, each repeating one chat template's control string (the context names it)
# or none: each copy must count as text, never as the control token
CHAT_CONTROLS = "chat-controls"

# Contexts: when a request was sent.
BASELINE = "baseline"


def after(flavour: str, round_: int) -> str:
    """B's probes right after a pollution burst of this flavour ("A" marker or "N" neutral)."""
    return f"after-{flavour}-{round_}"


def during(flavour: str, round_: int, attempt: int = 1) -> str:
    """B's long answer while a pollution burst of this flavour runs next to it (`attempt`: sent
    again because the last one ended before the burst did)."""
    return f"during-{flavour}-{round_}" + (f"-again-{attempt}" if attempt > 1 else "")


@dataclass(slots=True)
class Answer:
    tenant: str
    probe: str  # a boundary probe's name, "concurrent", or one of the names above
    context: str  # calibration, baseline, after-A-1, during-N-2, ...
    prompt_tokens: int | None  # exact length when sent as token ids; None for text prompts
    status: int  # HTTP status of the response
    seconds: float  # the whole request
    ttft: float | None = None  # seconds to the first token
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    error_code: str | None = None  # from an error body, or an error event inside a 200 stream
    error_message: str | None = None
    stream_error: bool = False  # the error came after a 200 header, inside the stream
    flavour: str | None = None  # pollution requests: "A" or "N"
    repeats: int | None = None  # chat-controls requests: the copies of the control string sent

    @property
    def ok(self) -> bool:
        """A complete answer: 200 and no error inside the stream."""
        return self.status == 200 and not self.stream_error

    def describe(self) -> str:
        if self.ok:
            return "200"
        if self.stream_error:
            return f"200 whose stream ended in error {self.error_code}: {self.error_message}"
        return f"{self.status} {self.error_code or ''}".strip()

    def compact(self) -> dict[str, Any]:
        """For the report: everything but the per-token arrays."""
        return {
            "tenant": self.tenant,
            "probe": self.probe,
            "context": self.context,
            "flavour": self.flavour,
            "repeats": self.repeats,
            "prompt_tokens": self.prompt_tokens,
            "status": self.status,
            "error_code": self.error_code,
            "stream_error": self.stream_error,
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "usage_cached_tokens": self.usage_cached_tokens,
            "completion_tokens": len(self.tokens),
            "ttft": None if self.ttft is None else round(self.ttft, 4),
            "seconds": round(self.seconds, 4),
            "text": self.text[:120],
        }
