"""What `kvfence up` shows of engines that load: each engine's phases from its /readyz, from
the moment its process starts to the moment it is ready, none left where it was last polled,
and its lines apart from the bars (EngineProgress, fed /readyz answers here as the watcher
thread feeds them)."""

import io

from helpers.terminal import FakeTerminal, screen
from kvfence_engine.contracts import EngineReadiness, ProgressReport
from kvfence_engine.tools.progress import say, tick_all
from kvfence_operator.local.up import STARTING_STEP, EngineProgress

LOADING = "loading builtin:smollm2-135m-instruct"
CONVERTING = "converting SmolLM2-135M-Instruct.Q4_1.gguf"


def step(done: int, name: str) -> ProgressReport:
    line = f"{LOADING} [{done}/5] {name}"
    return ProgressReport(label=LOADING, done=done, total=5, unit="step", line=line, step=name)


def loading(done: int, name: str) -> EngineReadiness:
    return EngineReadiness(status="loading", progress=step(done, name))


def converting(done: int) -> EngineReadiness:
    """As an engine's /readyz says it: the conversion, within its load step."""
    line = f"{CONVERTING}: {done}/272 tensors"
    within = step(2, "dequantizing the weights")
    report = ProgressReport(
        label=CONVERTING, done=done, total=272, unit="tensor", line=line, within=within
    )
    return EngineReadiness(status="loading", progress=report)


def test_every_phase_of_a_start_is_said_and_a_phase_moved_on_from_is_finished():
    lines: list[str] = []
    shown = EngineProgress(["e-0"], lines.append, stream=io.StringIO())
    assert lines == [f"  e-0: starting [1/1] {STARTING_STEP}"]  # before it answers anything
    shown.show("e-0", None)  # not answering yet
    shown.show("e-0", loading(1, "reading SmolLM2-135M-Instruct.Q4_1.gguf"))
    shown.show("e-0", converting(30))  # step 2 is said from the report it is within
    shown.show("e-0", converting(256))
    # the last 16 tensors converted between two polls: the engine reports its next step
    shown.show("e-0", loading(4, "saving the converted weights to the cache"))
    shown.show("e-0", loading(5, "building the model on cpu and allocating its KV pool"))
    shown.finish("e-0")
    shown.show("e-0", loading(5, "a report polled before it was ready"))  # ignored: finished
    shown.close()
    assert lines == [
        f"  e-0: starting [1/1] {STARTING_STEP}",
        f"  e-0: {LOADING} [1/5] reading SmolLM2-135M-Instruct.Q4_1.gguf",
        f"  e-0: {LOADING} [2/5] dequantizing the weights",
        f"  e-0: {CONVERTING}: 30/272 tensors",
        f"  e-0: {CONVERTING}: 256/272 tensors",
        f"  e-0: {CONVERTING}: 272/272 tensors",  # finished, not left at 94%
        f"  e-0: {LOADING} [4/5] saving the converted weights to the cache",
        f"  e-0: {LOADING} [5/5] building the model on cpu and allocating its KV pool",
    ]


def test_a_ready_line_goes_above_the_other_engines_bars_on_a_terminal():
    terminal = FakeTerminal()
    shown = EngineProgress(["e-0", "e-1"], lambda text: say(text, terminal), stream=terminal)
    for name in ("e-0", "e-1"):
        shown.show(name, loading(2, "dequantizing the weights"))
        shown.show(name, converting(200))
    shown.finish("e-0")  # what wait_ready does before it says the engine is ready
    say("  e-0 ready (64s) on http://127.0.0.1:40215", terminal)
    shown.show("e-1", converting(250))
    rows = screen(terminal.getvalue())
    ready = rows.index("  e-0 ready (64s) on http://127.0.0.1:40215")
    finished = [i for i, row in enumerate(rows) if row.startswith(f"  e-0: {CONVERTING}: 272/272")]
    assert finished and finished[0] < ready, rows  # e-0's bar gave way to its last line
    assert any(row.startswith(f"  e-1: {CONVERTING}:") and "%|" in row
               for row in rows[ready + 1 :]), rows  # fmt: skip
    assert not any("e-0" in row and "%|" in row for row in rows), rows  # no e-0 bar is left
    shown.close()


def test_a_phase_that_runs_on_says_so_and_only_the_latest_one_speaks():
    """Off a terminal, every 10 s without a line: the engine's latest work says its line
    again; the step it runs within waits (it is not where the engine is), then speaks again."""
    lines: list[str] = []
    now = [0.0]
    shown = EngineProgress(["e-0"], lines.append, stream=io.StringIO(), clock=lambda: now[0])
    shown.show("e-0", loading(2, "dequantizing the weights"))
    shown.show("e-0", converting(30))
    now[0] = 30.0
    tick_all()
    shown.show("e-0", loading(3, "building the tokenizer"))
    now[0] = 45.0
    tick_all()
    shown.finish("e-0")
    now[0] = 90.0
    tick_all()  # finished: nothing more
    shown.close()
    assert lines[2:] == [
        f"  e-0: {CONVERTING}: 30/272 tensors",
        f"  e-0: {CONVERTING}: 30/272 tensors (still at it after 30s)",
        f"  e-0: {CONVERTING}: 272/272 tensors",
        f"  e-0: {LOADING} [3/5] building the tokenizer",
        f"  e-0: {LOADING} [3/5] building the tokenizer (still at it after 15s)",
    ], lines
