"""The devcluster's controller loops (the kubelet's, the kube-proxy's) wait for their next pass
with `woken`, and stop when cancelled, however the cancellation and a wake-up fall together."""

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

from kvfence_devcluster.loop import woken

Wait = Callable[[asyncio.Event], Awaitable[None]]


async def cancelled_as_woken(wait: Wait) -> bool:
    """A controller loop, woken and cancelled in the same moment (a write to the store as the
    cluster is torn down): True if it stopped."""
    event = asyncio.Event()

    async def controller() -> None:
        while True:
            event.clear()
            await wait(event)
            await asyncio.sleep(0)

    task = asyncio.create_task(controller())
    await asyncio.sleep(0.01)  # waiting for its next pass
    event.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    task.cancel()  # what ran on stops now, whatever it was doing
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return bool(done)


def test_a_loop_woken_as_it_is_cancelled_stops() -> None:
    assert asyncio.run(cancelled_as_woken(lambda event: woken(event, 10.0)))


def test_with_wait_for_instead_the_loop_ran_on_on_this_python() -> None:
    """The negative control: asyncio.wait_for drops that cancellation on Python 3.11 (CPython
    gh-86296; 3.12 keeps it), which hung the cluster's teardown for its whole limit."""

    async def wait_for(event: asyncio.Event) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), 10.0)

    assert asyncio.run(cancelled_as_woken(wait_for)) == (sys.version_info >= (3, 12))
