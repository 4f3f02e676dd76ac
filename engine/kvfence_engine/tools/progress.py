"""Progress a person can watch on long steps: a tqdm bar on a terminal, plain lines otherwise
(a pipe, a log file, a pod's log), where a redrawn bar would be noise.

Two kinds of work use it: named steps (the canary's phases: one line per step) and counted
units (tensors converted while loading a model: a line every tenth of the way).

`current()` reports the latest unfinished one in this process: an engine's /readyz carries it
while loading, so `kvfence up` (whose engines log to files) can show it.
It is process-wide on purpose: the loader runs deep inside an engine's build, and /readyz
reports on the process, not on one call chain.
"""

import sys
import threading
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

from kvfence_engine.contracts import ProgressReport

_lock = threading.Lock()
_unfinished: list["Progress"] = []


def current() -> ProgressReport | None:
    """The latest unfinished progress of this process, or None."""
    with _lock:
        latest = _unfinished[-1] if _unfinished else None
    return latest.report() if latest is not None else None


class Progress:
    """`total` steps or units of `label`. On a terminal (`stream` is a tty) a bar is drawn on
    `stream`; otherwise `write` gets plain lines (default: printed to `stream`)."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "step",
        stream: TextIO | None = None,
        write: Callable[[str], None] | None = None,
        lines: int = 10,
    ) -> None:
        self.label = label
        self.total = max(1, total)
        self.unit = unit
        self.done = 0
        self.step = ""
        self._lock = threading.Lock()  # a loader thread advances, an HTTP thread reads `line`
        stream = stream or sys.stdout
        self._stream = stream
        self._write = write or (lambda text: print(text, file=stream, flush=True))
        self._every = max(1, self.total // lines)  # counted units: a plain line this often
        self._bar: tqdm | None = None
        if stream.isatty():
            self._bar = tqdm(total=self.total, desc=label, unit=unit, file=stream, leave=True)
        with _lock:
            _unfinished.append(self)

    @property
    def line(self) -> str:
        with self._lock:
            if self.step:
                return f"{self.label} [{self.done}/{self.total}] {self.step}"
            return f"{self.label}: {self.done}/{self.total} {self.unit}s"

    def report(self) -> ProgressReport:
        with self._lock:
            done = self.done
        return ProgressReport(
            label=self.label, done=done, total=self.total, unit=self.unit, line=self.line
        )

    def move_to(self, done: int) -> None:
        """Where someone else's report says the work is (`kvfence up` showing an engine's)."""
        self.advance(done - self.done)

    def start_step(self, name: str) -> None:
        """The next named step starts (steps count from 1 as they start)."""
        with self._lock:
            self.done = min(self.done + 1, self.total)
            self.step = name
        if self._bar is not None:
            self._bar.set_postfix_str(name, refresh=False)
            self._bar.update(self.done - self._bar.n)
        else:
            self._write(self.line)

    def say(self, text: str) -> None:
        """A line of its own, between the steps: above the bar on a terminal (never inside
        it), through `write` otherwise."""
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            self._write(text)

    def advance(self, units: int = 1) -> None:
        """`units` more of the total are done."""
        with self._lock:
            before, self.done = self.done, max(0, min(self.done + units, self.total))
        if self._bar is not None:
            self._bar.update(self.done - before)
        elif self.done > before and (
            self.done // self._every > before // self._every or self.done == self.total
        ):
            self._write(self.line)

    def close(self) -> None:
        with _lock:
            if self in _unfinished:
                _unfinished.remove(self)
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
