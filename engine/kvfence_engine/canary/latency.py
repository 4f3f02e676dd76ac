"""How long a prefill takes on this target, measured on it: the floor under which a first token
means the prompt was not really processed (a placeholder, a truncation, a shared cache).

Only monotonicity is assumed: prefilling n tokens takes at least as long as prefilling any
shorter prompt. The fastest of several first-token times per length is kept, since noise only
ever adds time. A 1-token prompt's first token is the overhead (HTTP, routing, transfer setup)."""

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from kvfence_engine.canary.observations import CALIBRATION, TENANT_B, Answer


@dataclass(frozen=True, slots=True)
class Reference:
    length: int  # the longest calibrated prompt not longer than the judged one
    prefill: float  # seconds its prefill took beyond the overhead


@dataclass(frozen=True, slots=True)
class PrefillCalibration:
    overhead: float
    fastest: dict[int, float]  # prompt length -> fastest first token seen

    @classmethod
    def from_answers(cls, answers: Iterable[Answer]) -> "PrefillCalibration | None":
        fastest: dict[int, float] = {}
        for a in answers:
            if a.probe == CALIBRATION and a.tenant == TENANT_B and a.ok and a.ttft is not None:
                assert a.prompt_tokens is not None
                fastest[a.prompt_tokens] = min(a.ttft, fastest.get(a.prompt_tokens, a.ttft))
        if 1 not in fastest:
            return None
        return cls(fastest[1], dict(sorted(fastest.items())))

    def reference(self, length: int) -> Reference | None:
        shorter = [n for n in self.fastest if 1 < n <= length]
        if not shorter:
            return None
        n = max(shorter)
        return Reference(n, max(0.0, self.fastest[n] - self.overhead))


def decode_seconds_per_token(answers: Iterable[Answer]) -> float | None:
    """Median time between tokens in the calibration answers that produced several."""
    rates = [
        (a.seconds - a.ttft) / (len(a.tokens) - 1)
        for a in answers
        if a.probe == CALIBRATION and a.ok and a.ttft is not None and len(a.tokens) > 1
    ]
    return statistics.median(rates) if rates else None
