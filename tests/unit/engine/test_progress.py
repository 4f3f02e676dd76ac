"""Progress on long steps: a bar on a terminal, plain lines anywhere else."""

import io
import os
import threading

from helpers.terminal import FakeTerminal, screen
from kvfence_engine.contracts import ProgressReport
from kvfence_engine.tools.progress import Progress, current, say


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


def test_the_latest_unfinished_progress_is_reported_within_the_ones_before_it():
    """An engine's /readyz: its conversion, within the load step it is part of."""
    quiet = io.StringIO()
    with Progress("loading x.gguf", 5, write=lambda _: None, stream=quiet) as loading:
        loading.start_step("dequantizing the weights")
        with Progress("converting x.gguf", 272, unit="tensor", write=lambda _: None,
                      stream=quiet) as converting:  # fmt: skip
            converting.advance(30)
            report = current()
            assert report is not None and report.line == "converting x.gguf: 30/272 tensors"
            assert report.within is not None and report.within.within is None
            assert report.within.line == "loading x.gguf [1/5] dequantizing the weights"
        report = current()
        assert report is not None and report.label == "loading x.gguf" and report.within is None


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


def _two_bars_and_a_line(write_line) -> list[str]:
    terminal = FakeTerminal()
    with (
        Progress("  e-0: converting", 272, unit="tensor", stream=terminal) as first,
        Progress("  e-1: converting", 272, unit="tensor", stream=terminal) as second,
    ):
        first.advance(100)
        second.advance(50)
        first.tick()  # drawn now, whatever tqdm's own redraw interval
        second.tick()
        write_line("  e-0 ready (9s) on http://127.0.0.1:40215", terminal)
        first.advance(10)
        second.advance(10)
        shown = screen(terminal.getvalue())
    return shown


def test_a_line_said_while_bars_are_drawn_is_a_row_of_its_own_above_them():
    shown = _two_bars_and_a_line(say)
    line = "  e-0 ready (9s) on http://127.0.0.1:40215"
    assert line in shown, shown
    below = shown[shown.index(line) + 1 :]
    assert any(row.startswith("  e-0: converting") and "%|" in row for row in below), shown
    assert any(row.startswith("  e-1: converting") and "%|" in row for row in below), shown
    # no row mixes the line with a bar
    assert all("ready" not in row for row in shown if "converting" in row), shown


def test_a_line_printed_past_the_progress_module_lands_inside_a_bar():
    """The negative control: what `kvfence up` did before its lines went through `say`."""
    shown = _two_bars_and_a_line(lambda text, stream: print(text, file=stream))
    line = "  e-0 ready (9s) on http://127.0.0.1:40215"
    assert line not in shown, shown
    assert any("converting" in row and "ready" in row for row in shown), shown


def test_a_closed_bar_gives_way_to_its_last_line_and_the_time_it_took():
    terminal = FakeTerminal()
    now = [100.0]
    with Progress("converting model.gguf", 4, unit="tensor", stream=terminal,
                  clock=lambda: now[0]) as converting:  # fmt: skip
        converting.advance(4)
        now[0] = 141.0
    shown = [row for row in screen(terminal.getvalue()) if row]
    assert shown == ["converting model.gguf: 4/4 tensors (41s in all)"], shown


def test_a_quiet_step_off_a_terminal_is_said_again_every_quiet_seconds():
    lines: list[str] = []
    now = [0.0]
    with Progress("canary", 3, write=lines.append, stream=io.StringIO(), quiet=10.0,
                  clock=lambda: now[0]) as steps:  # fmt: skip
        steps.start_step("baseline")
        for now[0] in (5.0, 9.9):
            steps.tick()
        assert lines == ["canary [1/3] baseline"]
        for now[0] in (10.0, 15.0, 20.0):
            steps.tick()
        steps.start_step("round 1")  # a line of its own: the quiet counts from it
        for now[0] in (25.0, 30.5):
            steps.tick()
    assert lines == [
        "canary [1/3] baseline",
        "canary [1/3] baseline (still at it after 10s)",
        "canary [1/3] baseline (still at it after 20s)",
        "canary [2/3] round 1",
        "canary [2/3] round 1 (still at it after 10s)",
    ]


def test_without_quiet_a_progress_off_a_terminal_says_nothing_between_its_lines():
    """An engine's own log: its conversion's tenths, no more (the negative control)."""
    lines: list[str] = []
    now = [0.0]
    with Progress("converting", 272, unit="tensor", write=lines.append, stream=io.StringIO(),
                  clock=lambda: now[0]) as converting:  # fmt: skip
        now[0] = 600.0
        converting.tick()
    assert lines == []


def test_a_bar_is_redrawn_by_ticks_so_its_clock_moves_through_a_long_step():
    terminal = FakeTerminal()
    with Progress("canary", 3, stream=terminal) as steps:
        steps.start_step("baseline")
        before = terminal.getvalue()
        steps.tick()
        assert terminal.getvalue() != before and "baseline" in terminal.getvalue()[len(before) :]


def test_a_copy_follows_anothers_reports_steps_by_name_and_units_by_count():
    """`kvfence up` shows an engine's /readyz progress with a Progress of its own."""
    engine_lines: list[str] = []
    shown_lines: list[str] = []
    quiet = io.StringIO()
    with (
        Progress("loading x.gguf", 3, write=engine_lines.append, stream=quiet) as engine,
        Progress("  e-0: loading x.gguf", 3, write=shown_lines.append, stream=quiet) as shown,
    ):
        engine.start_step("reading x.gguf")
        shown.follow(engine.report())
        shown.follow(engine.report())  # the same report again: nothing new to say
        engine.start_step("dequantizing the weights")
        engine.start_step("building the tokenizer")  # two steps between polls
        shown.follow(engine.report())
    assert shown_lines == [
        "  e-0: loading x.gguf [1/3] reading x.gguf",
        "  e-0: loading x.gguf [3/3] building the tokenizer",
    ]
    counted: list[str] = []
    with Progress("  e-0: converting", 272, unit="tensor", write=counted.append,
                  stream=quiet) as copy:  # fmt: skip
        copy.follow(ProgressReport(label="converting", done=256, total=272, unit="tensor",
                                   line="converting: 256/272 tensors"))  # fmt: skip
        copy.finish()  # the engine moved on: its last tensors converted between two polls
    assert counted == ["  e-0: converting: 256/272 tensors", "  e-0: converting: 272/272 tensors"]
