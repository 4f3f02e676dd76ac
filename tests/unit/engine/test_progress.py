"""Progress on long steps: a bar on a terminal, plain lines anywhere else."""

import io
import os
import threading

from kvfence_engine.tools.progress import Progress, current


def test_named_steps_are_one_plain_line_each_off_a_terminal():
    lines: list[str] = []
    with Progress("canary", 3, write=lines.append, stream=io.StringIO()) as steps:
        for name in ("discovering", "baseline", "counters"):
            steps.start_step(name)
    assert lines == ["canary [1/3] discovering", "canary [2/3] baseline", "canary [3/3] counters"]


def test_counted_units_are_a_line_every_tenth_of_the_way_and_one_at_the_end():
    lines: list[str] = []
    # closed at the end (the with): an unfinished progress is what this whole process reports
    with Progress("converting weights", 272, unit="tensor", write=lines.append,
                  stream=io.StringIO()) as loading:  # fmt: skip
        for _ in range(272):
            loading.advance()
        loading.advance()  # past the end: nothing more to say
        report = current()
        assert report is not None and report.label == "converting weights"
    assert current() is None
    assert len(lines) == 11, lines
    assert lines[0] == "converting weights: 27/272 tensors"
    assert lines[-1] == "converting weights: 272/272 tensors"
    assert loading.line == "converting weights: 272/272 tensors"


def test_a_terminal_gets_a_redrawn_bar_and_no_plain_lines():
    """A real pseudo-terminal: what a person running `kvfence up` in a shell sees."""
    controller, terminal = os.openpty()
    seen = bytearray()
    reader = threading.Thread(target=lambda: _drain(controller, seen), daemon=True)
    reader.start()
    lines: list[str] = []
    with open(terminal, "w") as stream, Progress("canary", 4, write=lines.append,
                                                stream=stream) as steps:  # fmt: skip
        steps.start_step("discovering the target")
        steps.start_step("baseline")
    reader.join(timeout=5)
    os.close(controller)
    shown = seen.decode(errors="replace")
    assert lines == []
    assert "\r" in shown and "canary:" in shown and "2/4" in shown and "baseline" in shown


def _drain(fd: int, into: bytearray) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the terminal side closed
            return
        if not chunk:
            return
        into += chunk
