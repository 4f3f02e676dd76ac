"""eventually(): the one way the tests (and the test cluster's `Cluster.wait_for`) wait for
something to become true. It polls an observation, never sleeps a guessed time, and on a
timeout says what it waited for and what it saw last. A timeout is a hang guard, never a
budget: what a test asserts is the fact, and a loaded 2-core machine may take many times a
quiet one's time to reach it (issue 34), so the default ceiling is generous.

It lives here, not in tests/helpers, because `Cluster.wait_for` (fixtures.py) is this same
loop with the cluster's state added to the failure, and this installed package cannot import
the tests' helpers; the tests import it from tests/helpers/waits.py."""

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar, overload

from kvfence_engine.tools.localproc import READY_TIMEOUT_SECONDS

T = TypeVar("T")

FACT_S = 120.0
"""The default ceiling on a fact coming true (a pod gone, a line logged): seconds on a quiet
machine, and the fact, not the time, is what is tested."""

READY_S = READY_TIMEOUT_SECONDS
"""The ceiling on a process or a deployment becoming ready (an engine loading, a cluster's
InferenceDeployment Ready): LocalProcess.wait_ready's own default, for the same reason."""


class GiveUp(Exception):
    """Raised by an observation that can no longer come true (the process it reads exited):
    eventually() fails at once with this message instead of waiting out its timeout."""


def short(value: Any, limit: int = 3000) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


@overload
def eventually(
    observe: Callable[[], T | None],
    what: str,
    timeout: float = FACT_S,
    *,
    interval: float = 0.1,
    describe: Callable[[], str] | None = None,
) -> T: ...


@overload
def eventually(
    observe: Callable[[], T],
    what: str,
    timeout: float = FACT_S,
    until: Callable[[T], object] = bool,
    interval: float = 0.1,
    describe: Callable[[], str] | None = None,
) -> T: ...


def eventually(
    observe: Callable[[], T],
    what: str,
    timeout: float = FACT_S,
    until: Callable[[T], object] = bool,
    interval: float = 0.1,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll `observe()` until `until(value)` holds and return that value. An observation that
    raises is an observation too (retried), except GiveUp. On timeout, fail (AssertionError)
    naming `what`, the last value observed and, with `describe`, what it says.

    Without `until` the value returned is truthy, so never None: an observation typed
    `X | None` (a lookup) returns an X (the first overload)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = observe()
            if until(last):
                return last
        except GiveUp as exc:
            raise AssertionError(f"gave up waiting for {what}: {exc}") from None
        except Exception as exc:
            last = exc
        if time.monotonic() >= deadline:
            seen = repr(last) if isinstance(last, Exception) else short(last)
            context = f"\n\n{describe()}" if describe is not None else ""
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what}; last observed: {seen}{context}"
            )
        time.sleep(interval)
