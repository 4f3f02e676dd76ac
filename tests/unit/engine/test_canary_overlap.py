"""B's long answer during tenant A's burst is sent again while it ends before the burst does
(canary/run.py, OVERLAP_TRIES): only tokens B decodes after A's KV is in the pool can show a
page B lost to A, and on a machine that got faster or busier since calibration one answer may
be too short for that."""

import asyncio
from collections.abc import Callable

import pytest

from kvfence_engine.canary.config import CanaryConfig
from kvfence_engine.canary.observations import TENANT_B, Answer
from kvfence_engine.canary.prompts import Probe
from kvfence_engine.canary.run import OVERLAP_TRIES, CanaryRun

PROBE = Probe("concurrent", 64, True, "B decodes while A fills the pool", 32)


class ScriptedRun(CanaryRun):
    """B's answers end at once, unless their attempt is in `outliving`: those end only after
    the burst has been answered. Nothing is sent anywhere."""

    def __init__(self, outliving: set[int]) -> None:
        super().__init__(CanaryConfig("http://127.0.0.1:9", "key-a", "key-b"), seed=1)
        self.outliving = outliving
        self.sent: list[str] = []
        self.burst_answered = asyncio.Event()

    async def ask_b(
        self, probe: Probe, context: str, on_first_token: Callable[[], None] | None = None
    ) -> Answer:
        self.sent.append(context)
        self.burst_answered.clear()
        assert on_first_token is not None
        on_first_token()
        if len(self.sent) in self.outliving:
            await self.burst_answered.wait()
        else:
            await asyncio.sleep(0)
        return Answer(TENANT_B, probe.name, context, probe.length, 200, 0.1)

    def burst_lengths(self, keep_free: int) -> list[int]:
        return [16]

    async def pollute(self, flavour: str, context: str, lengths: list[int]) -> None:
        for _ in range(3):  # B's answer, if it ends at once, ends meanwhile
            await asyncio.sleep(0)
        self.burst_answered.set()


def concurrent_answers(outliving: set[int]) -> ScriptedRun:
    run = ScriptedRun(outliving)
    asyncio.run(run.concurrent_answers(PROBE, "A", 1))
    return run


def test_an_answer_that_outlives_the_burst_is_sent_once() -> None:
    run = concurrent_answers({1})
    assert run.sent == ["during-A-1"]
    assert run.overlapped == ["during-A-1"]


def test_an_answer_that_ends_first_is_sent_again_until_one_outlives_the_burst() -> None:
    run = concurrent_answers({2})
    assert run.sent == ["during-A-1", "during-A-1-again-2"]
    assert run.overlapped == ["during-A-1-again-2"]


@pytest.mark.parametrize("outliving", [set(), {OVERLAP_TRIES + 1}])
def test_at_most_overlap_tries_answers_are_sent(outliving: set[int]) -> None:
    run = concurrent_answers(outliving)
    assert run.sent == ["during-A-1", "during-A-1-again-2", "during-A-1-again-3"]
    assert len(run.sent) == OVERLAP_TRIES and run.overlapped == []
