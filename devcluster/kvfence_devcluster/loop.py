"""An asyncio event loop in a daemon thread: the API server and the kubelet live there, the
test's own code stays synchronous and reaches them over HTTP (or with `run`)."""

import asyncio
import contextlib
import io
import sys
import threading
import traceback
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def woken(event: asyncio.Event, timeout: float) -> None:
    """Until `event` is set or `timeout` seconds have passed: a controller loop's wait for its
    next pass. Not asyncio.wait_for, which on Python 3.11 drops a cancellation that lands just
    as the event is set (CPython gh-86296): the loop then runs on, and the cluster's teardown,
    which cancels it and waits, hung for its whole limit on a loaded machine."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


class BackgroundLoop:
    def __init__(self, name: str = "test-cluster") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # Let cancelled tasks and async generators finish their cleanup before closing.
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def start(self) -> "BackgroundLoop":
        self._thread.start()
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        """Run a coroutine on the loop and wait for its result from this thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stacks(self) -> str:
        """Where the loop's thread and each of its tasks are now (read from another thread, for
        a report: say why a wait on the loop ran out)."""
        report = io.StringIO()
        frame = sys._current_frames().get(self._thread.ident or -1)
        report.write("loop thread:\n" + "".join(traceback.format_stack(frame)) if frame else "")
        for task in list(asyncio.all_tasks(self.loop)):
            task.print_stack(file=report)
        return report.getvalue()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
