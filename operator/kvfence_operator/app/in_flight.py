"""The reconcile passes running now, so that a stopping operator gives up its Lease only after
them.

kopf runs a sync timer in its thread pool. Stopping (SIGTERM: a chart rolling update, a node
drain), it cancels the task that awaits the pass, not the thread that runs it, and `kopf.run`
returns: a Lease released then lets the next leader start while this pass still writes, two
writers on one object. `kvfence operator` waits for `idle()` before it releases.
"""

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class PassesInFlight:
    _count: int = field(default=0, init=False)
    _changed: threading.Condition = field(default_factory=threading.Condition, init=False)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._changed:
            self._count += 1
        try:
            yield
        finally:
            with self._changed:
                self._count -= 1
                self._changed.notify_all()

    def idle(self, timeout: float) -> bool:
        """Wait until no pass runs, at most `timeout` seconds; whether none does."""
        with self._changed:
            return self._changed.wait_for(lambda: self._count == 0, timeout)
