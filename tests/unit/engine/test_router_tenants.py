"""The router's count of each tenant's requests in flight (--max-concurrent-per-tenant): a
place is taken at admission and given back exactly once, however the answer ends."""

import asyncio
import gc
from collections.abc import AsyncIterator

import pytest

from kvfence_engine.core.errors import EngineError
from kvfence_engine.router.tenants import TenantInflight


async def tokens(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


def test_a_tenant_at_its_limit_gets_429_and_another_tenant_does_not() -> None:
    inflight = TenantInflight(2)
    held = [inflight.enter("a"), inflight.enter("a")]
    with pytest.raises(EngineError) as refused:
        inflight.enter("a")
    error = refused.value
    assert (error.status, error.type, error.code, error.retry_after) == (
        429,
        "requests",
        "tenant_limit",
        1,
    )
    inflight.enter("b").release()
    held[0].release()
    held[0].release()  # a second release gives nothing back twice
    assert inflight.counts == {"a": 1, "b": 0}
    inflight.enter("a")


def test_no_limit_by_default() -> None:
    inflight = TenantInflight()
    for _ in range(1000):
        inflight.enter("a")
    assert inflight.counts == {"a": 1000}


def test_a_stream_gives_its_place_back_when_it_ends_or_is_closed_early() -> None:
    async def run() -> None:
        inflight = TenantInflight(1)
        whole = inflight.enter("a").held_until_closed(tokens(3))
        assert [t async for t in whole] == [0, 1, 2]
        assert inflight.counts == {"a": 0}
        early = inflight.enter("a").held_until_closed(tokens(100))
        assert await anext(early) == 0
        assert inflight.counts == {"a": 1}
        await early.aclose()  # the client hung up
        assert inflight.counts == {"a": 0}

    asyncio.run(run())


def test_a_stream_that_never_started_gives_its_place_back_when_dropped() -> None:
    inflight = TenantInflight(1)
    stream = inflight.enter("a").held_until_closed(tokens(3))
    assert inflight.counts == {"a": 1}
    del stream
    gc.collect()
    assert inflight.counts == {"a": 0}
