"""`--weight-dtype auto` keeps what it measured (core/choice_cache.py): a second start of the
same model on the same machine packs as measured without measuring; another CPU, torch or
thread count is another question; a file that does not parse or answers another question is
measured again; a directory it cannot write is no failure."""

import json
from pathlib import Path

import pytest
import torch

from helpers.engines import tiny_q4
from kvfence_engine.core import build
from kvfence_engine.core.choice_cache import ChoiceCache
from kvfence_engine.core.decoder import Decoder
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.quantization import Int4Linear, WeightDtype
from kvfence_engine.core.weight_choice import ROUNDS, StepTimes, choose

INT4, HYBRID = WeightDtype.INT4, WeightDtype.INT4_FLOAT16
# AVX2-like: int4+float16 wins (test_weight_choice.py's figures)
TIMES = {INT4: StepTimes(17.2, 81.7, 16, 199), HYBRID: StepTimes(17.3, 69.5, 16, 117)}


class Measured:
    """build.step_times, scripted: TIMES for whichever packing the model holds; counts the
    measurements."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, rows: int):
        def timed(model: Decoder) -> StepTimes:
            self.count += 1
            hybrid = any(isinstance(m, Int4Linear) and m.wide is not None for m in model.modules())
            return TIMES[HYBRID if hybrid else INT4]

        return timed


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> Measured:
    counter = Measured()
    monkeypatch.setattr(build, "step_times", counter)
    return counter


def start(cache: Path | None) -> LLMEngine:
    args = EngineArgs(
        kv_cache_memory=16 << 20, weight_choice_cache=None if cache is None else str(cache)
    )
    return LLMEngine(tiny_q4(), args)


def switches(engine: LLMEngine) -> list[int]:
    return [m.wide_above for m in engine.runner.model.modules() if isinstance(m, Int4Linear)]


def test_a_second_start_packs_as_the_first_measured_without_measuring(
    tmp_path: Path, measured: Measured
) -> None:
    first = start(tmp_path)
    assert measured.count == 2 * ROUNDS and first.precision.weights == HYBRID
    assert first.precision.why == choose(TIMES).reason()
    [kept] = list(tmp_path.iterdir())
    second = start(tmp_path)
    assert measured.count == 2 * ROUNDS, "the second start measured nothing"
    assert second.precision.weights == HYBRID
    assert switches(second) == switches(first)  # int4+float16's switches, as measured
    why = second.precision.why
    assert why is not None and why.startswith(choose(TIMES).reason())
    assert why.endswith(f", kept in {kept})")
    assert second.kvpool_report().weight_choice == why
    start(None)  # no cache: measured again
    assert measured.count == 4 * ROUNDS


def test_another_thread_count_or_instruction_set_is_another_question(
    tmp_path: Path, measured: Measured, monkeypatch: pytest.MonkeyPatch
) -> None:
    start(tmp_path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        start(tmp_path)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    start(tmp_path)
    assert measured.count == 3 * 2 * ROUNDS
    assert len(list(tmp_path.iterdir())) == 3


def test_a_broken_or_foreign_file_is_measured_again_and_rewritten(
    tmp_path: Path, measured: Measured
) -> None:
    start(tmp_path)
    [kept] = list(tmp_path.iterdir())
    kept.write_text("{not json")
    start(tmp_path)
    assert measured.count == 2 * 2 * ROUNDS
    body = json.loads(kept.read_text())  # rewritten whole
    body["key"]["torch"] = "0.0"  # another question's answer under this name
    kept.write_text(json.dumps(body))
    start(tmp_path)
    assert measured.count == 3 * 2 * ROUNDS
    assert json.loads(kept.read_text())["key"]["torch"] == torch.__version__
    for rows in (0, 8):  # no time to divide by; another batch than the one asked about
        body = json.loads(kept.read_text())
        body["times"][str(INT4)]["rows"] = rows
        kept.write_text(json.dumps(body))
        start(tmp_path)
    body = json.loads(kept.read_text())
    body["times"][str(HYBRID)]["decode_one"] = -1.0
    kept.write_text(json.dumps(body))
    start(tmp_path)
    assert measured.count == 6 * 2 * ROUNDS


def test_a_kept_measurement_decides_as_a_fresh_one_would(
    tmp_path: Path, measured: Measured
) -> None:
    """The file's times are what the choice is made of (each candidate serves the file's
    weights: an edited file picks a slower packing, never a wrong one)."""
    start(tmp_path)
    [kept] = list(tmp_path.iterdir())
    body = json.loads(kept.read_text())
    body["times"][str(HYBRID)]["prefill"] = 900.0  # int4+float16 now loses its prefills
    kept.write_text(json.dumps(body))
    engine = start(tmp_path)
    assert measured.count == 2 * ROUNDS
    assert engine.precision.weights == INT4
    assert not any(
        m.wide is not None for m in engine.runner.model.modules() if isinstance(m, Int4Linear)
    )


def test_a_directory_it_cannot_write_costs_the_measurement_only(
    tmp_path: Path, measured: Measured
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the directory would be")
    engine = start(blocked / "cache")
    assert engine.precision.weights == HYBRID and measured.count == 2 * ROUNDS
    assert not (blocked / "cache").exists()


def test_the_file_is_named_by_what_the_times_depend_on(tmp_path: Path) -> None:
    config = tiny_q4().config
    ask = ChoiceCache(tmp_path, config, (INT4, HYBRID), 16)
    assert ask.path == ChoiceCache(tmp_path, config, (INT4, HYBRID), 16).path
    assert ask.path != ChoiceCache(tmp_path, config, (INT4, HYBRID), 8).path
    assert ask.path != ChoiceCache(tmp_path, config, (INT4,), 16).path
    assert ask.key["torch"] == torch.__version__
    assert ask.key["capability"] == torch.backends.cpu.get_cpu_capability()
