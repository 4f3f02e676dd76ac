"""Progress a person can watch on long steps: a tqdm bar on a terminal, plain lines otherwise
(a pipe, a log file, a pod's log), where a redrawn bar would be noise.

Two kinds of work use it: named steps (the canary's phases, an engine's load phases: one line
per step) and counted units (tensors converted while loading a model: a line every tenth of
the way).

Lines and bars share a terminal through one place, `say`: a line is written above the bars
(tqdm clears them, the line is written, they are redrawn below it), never into one. Anything
that prints while bars may be drawn (`kvfence up` says everything through it) goes there.

On a terminal a bar is redrawn every second while it is open, so its clock moves through a
step that takes minutes; off a terminal, a progress given `quiet` says its line again after
that many seconds without one. No phase is silent.

`current()` reports the latest unfinished one in this process: an engine's /readyz carries it
while loading, so `kvfence up` (whose engines log to files) can show it.
It is process-wide on purpose: the loader runs deep inside an engine's build, and /readyz
reports on the process, not on one call chain.
"""

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

from kvfence_engine.contracts import ProgressReport

TICK_SECONDS = 1.0  # how often open bars are redrawn and quiet progresses checked

_lock = threading.Lock()
_unfinished: list["Progress"] = []
_ticker: threading.Thread | None = None


def current() -> ProgressReport | None:
    """The latest unfinished progress of this process, within the ones opened before it and
    unfinished too (`ProgressReport.within`: an engine's conversion, within its load step),
    or None."""
    with _lock:
        unfinished = list(_unfinished)
    report = None
    for progress in unfinished:
        report = progress.report().model_copy(update={"within": report})
    return report


def say(text: str, stream: TextIO | None = None) -> None:
    """A line of its own on `stream` (default stdout). Where bars are drawn (on this stream,
    or on the other of stdout and stderr, which share a terminal), they are cleared, the line
    is written and they are redrawn below it: the line is never inside a bar. Elsewhere it is
    simply printed. The one place that writes a line where bars may be."""
    stream = stream or sys.stdout
    tqdm.write(text, file=stream)
    stream.flush()


def tick_all() -> None:
    """Every open progress of this process ticks (Progress.tick): what a thread does every
    TICK_SECONDS once a bar, or a progress with `quiet`, is open."""
    with _lock:
        ticking = list(_unfinished)
    for progress in ticking:
        progress.tick()


def _tick_forever() -> None:
    while True:
        time.sleep(TICK_SECONDS)
        tick_all()


def _start_ticker() -> None:
    global _ticker
    with _lock:
        if _ticker is None:
            _ticker = threading.Thread(target=_tick_forever, name="kvfence-progress", daemon=True)
            _ticker.start()


class Progress:
    """`total` steps or units of `label`. On a terminal (`stream` is a tty) a bar is drawn on
    `stream`, unless `bar` is False; otherwise `write` gets plain lines (default: `say` on
    `stream`). With `quiet`, off a terminal, the line is said again after `quiet` seconds
    without one. `clock` is for tests: the seconds `tick` compares."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "step",
        stream: TextIO | None = None,
        write: Callable[[str], None] | None = None,
        lines: int = 10,
        quiet: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        bar: bool = True,
    ) -> None:
        self.label = label
        self.total = max(1, total)
        self.unit = unit
        self.done = 0
        self.step = ""
        self._lock = threading.Lock()  # a loader thread advances, an HTTP thread reads `line`
        stream = stream or sys.stdout
        self._stream = stream
        self._write = write or (lambda text: say(text, stream))
        self._every = max(1, self.total // lines)  # counted units: a plain line this often
        self.quiet = quiet  # may change while open (kvfence up: None while a nested one talks)
        self._clock = clock
        self._started = self._changed = self._said = clock()
        self._bar: tqdm | None = None
        if bar and stream.isatty():
            # leave=False: a closed bar gives way to its last line, said as a line (close)
            self._bar = tqdm(total=self.total, desc=label, unit=unit, file=stream, leave=False)
        with _lock:
            _unfinished.append(self)
        if self._bar is not None or quiet is not None:
            _start_ticker()

    @property
    def line(self) -> str:
        with self._lock:
            if self.step:
                return f"{self.label} [{self.done}/{self.total}] {self.step}"
            return f"{self.label}: {self.done}/{self.total} {self.unit}s"

    def report(self) -> ProgressReport:
        with self._lock:
            done, step = self.done, self.step
        return ProgressReport(
            label=self.label, done=done, total=self.total, unit=self.unit, line=self.line,
            step=step,
        )  # fmt: skip

    def follow(self, report: ProgressReport) -> None:
        """Where someone else's report says the work is (`kvfence up` showing an engine's):
        its named step, or its count."""
        if report.step:
            if (report.done, report.step) != (self.done, self.step):
                self._show_step(report.done, report.step)
        else:
            self.advance(report.done - self.done)

    def start_step(self, name: str) -> None:
        """The next named step starts (steps count from 1 as they start)."""
        self._show_step(self.done + 1, name)

    def _show_step(self, done: int, name: str) -> None:
        with self._lock:
            self.done = max(0, min(done, self.total))
            self.step = name
            self._changed = self._clock()
        if self._bar is not None:
            self._bar.set_postfix_str(name, refresh=False)
            self._bar.update(self.done - self._bar.n)
        else:
            self._say_line(self.line)

    def say(self, text: str) -> None:
        """A line of its own, between the steps: above the bar on a terminal (never inside
        it), through `write` otherwise."""
        if self._bar is not None:
            say(text, self._stream)
        else:
            self._say_line(text)

    def advance(self, units: int = 1) -> None:
        """`units` more of the total are done."""
        with self._lock:
            before, self.done = self.done, max(0, min(self.done + units, self.total))
            if self.done != before:
                self._changed = self._clock()
        if self._bar is not None:
            self._bar.update(self.done - before)
        elif self.done > before and (
            self.done // self._every > before // self._every or self.done == self.total
        ):
            self._say_line(self.line)

    def finish(self) -> None:
        """All of it is done, as someone else's work that was last seen short of the end
        (`kvfence up`'s copy of an engine's conversion, which that engine has moved on from):
        counted units say their last line; a named step was said when it started."""
        if self.step:
            with self._lock:
                self.done = self.total
            if self._bar is not None:
                self._bar.update(self.total - self._bar.n)
        else:
            self.advance(self.total - self.done)

    def tick(self) -> None:
        """Called every second while open: a bar is redrawn (its clock moves); off a terminal,
        with `quiet`, the line is said again once `quiet` seconds passed without one."""
        if self._bar is not None:
            self._bar.refresh()
            return
        quiet = self.quiet
        if quiet is None:
            return
        now = self._clock()
        with self._lock:
            due = now - self._said >= quiet
            if due:  # taken here: a tick of the thread and one of a caller say it once
                self._said = now
            since = now - self._changed
        if due:
            self._write(f"{self.line} (still at it after {since:.0f}s)")

    def _say_line(self, text: str) -> None:
        with self._lock:
            self._said = self._clock()
        self._write(text)

    def close(self) -> None:
        """Done with: not reported any more; on a terminal, the bar gives way to its last line
        and the time it took, said above the bars still open."""
        with _lock:
            if self in _unfinished:
                _unfinished.remove(self)
            else:
                return
        if self._bar is not None:
            self._bar.close()
            say(f"{self.line} ({self._clock() - self._started:.0f}s in all)", self._stream)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
