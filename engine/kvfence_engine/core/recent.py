"""A quantile over the last minute of a series (time to first token, inter-token latency):
what an autoscaler reads off an engine (contracts.LoadReport), without a Prometheus in
between. Samples older than the window are dropped as new ones come, and at most `capacity`
are kept (the newest), so memory is bounded whatever the rate."""

import math
import threading
import time
from collections import deque
from collections.abc import Callable

WINDOW_SECONDS = 60.0
CAPACITY = 4096


class RecentQuantile:
    def __init__(
        self,
        window: float = WINDOW_SECONDS,
        capacity: int = CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window = window
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=capacity)
        self._lock = threading.Lock()  # the engine thread observes, the HTTP thread reads

    def observe(self, value: float) -> None:
        with self._lock:
            self._samples.append((self.clock(), value))

    def quantile(self, q: float) -> float | None:
        """The q-quantile (nearest rank) of the samples within the window; None: none."""
        horizon = self.clock() - self.window
        with self._lock:
            while self._samples and self._samples[0][0] < horizon:
                self._samples.popleft()
            values = sorted(v for _, v in self._samples)
        if not values:
            return None
        return values[max(0, math.ceil(q * len(values)) - 1)]
