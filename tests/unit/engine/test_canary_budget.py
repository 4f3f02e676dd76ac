"""The canary's bounds on the load it adds (canary/target.py): a budget of requests, and with
--rate an average rate that still lets one pollution burst go at once."""

import asyncio
import time

import httpx
import pytest

from kvfence_engine.canary.config import CanaryConfig
from kvfence_engine.canary.target import CannotRun, TargetClient


def client(**bounds: float) -> TargetClient:
    config = CanaryConfig("http://target.test", "key-a", "key-b", **bounds)  # type: ignore[arg-type]
    target = TargetClient(config)
    target.http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    return target


async def send(target: TargetClient, count: int) -> list[float]:
    """When each of `count` requests, all asked for at once, was sent (seconds from the start)."""
    start, sent = time.monotonic(), []

    async def one() -> None:
        await target.get("/v1/models")
        sent.append(time.monotonic() - start)

    await asyncio.gather(*(one() for _ in range(count)))
    return sorted(sent)


def test_a_rate_lets_a_burst_go_at_once_then_paces_the_rest() -> None:
    target = client(rate=20.0, max_pollution_requests=4)
    sent = asyncio.run(send(target, 12))
    assert sent[3] < 0.1  # the burst: four at once
    # eight more at 20 a second: the last no sooner than 8/20 s after the start
    assert sent[-1] >= 0.35
    assert target.requests == 12


def test_without_a_rate_nothing_waits() -> None:
    sent = asyncio.run(send(client(max_pollution_requests=4), 12))
    assert sent[-1] < 0.2


def test_the_request_after_the_budget_is_refused_and_the_run_cannot_run() -> None:
    target = client(max_requests=3)
    asyncio.run(send(target, 3))
    with pytest.raises(CannotRun, match="budget of 3 requests is spent"):
        asyncio.run(send(target, 1))


def test_a_rate_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="--rate must be positive"):
        CanaryConfig("http://target.test", "key-a", "key-b", rate=0.0)
