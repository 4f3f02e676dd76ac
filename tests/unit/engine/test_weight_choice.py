"""`--weight-dtype auto` on CPU for a GGUF with 4-bit blocks: int4 or float16, measured at
start on the model itself (core/weight_choice.py). The choice is a pure function of the times;
packing each candidate in turn leaves the model as the chosen one; the engine says why."""

import pytest
import torch

from helpers.engines import generate, prompt_of, tiny_q4
from kvfence_engine.core.decoder import Decoder
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.quantization import Float16Linear, Int4Linear, WeightDtype
from kvfence_engine.core.weight_choice import (
    MARGIN,
    NEW_TOKENS,
    PREFILL_MEASURED,
    PROMPT_TOKENS,
    ROUNDS,
    StepTimes,
    choose,
)

INT4, FLOAT16 = WeightDtype.INT4, WeightDtype.FLOAT16

# Measured on SmolLM2-135M, 2 threads, AMD EPYC (Zen 4) (ms; decode 1 row, 16 rows, prefill 64)
ON_AVX512 = {INT4: StepTimes(14.6, 45.7, 16, 110), FLOAT16: StepTimes(18.0, 47.8, 16, 101)}
ON_AVX2 = {INT4: StepTimes(18.3, 59.1, 16, 163), FLOAT16: StepTimes(17.6, 47.7, 16, 106)}


def test_a_request_costs_its_prefill_and_its_share_of_each_decode_step() -> None:
    t = StepTimes(decode_one=10, decode_many=32, rows=16, prefill=20)
    prefill = 20 * PROMPT_TOKENS / PREFILL_MEASURED
    assert t.request_cost(1) == prefill + NEW_TOKENS * 10
    assert t.request_cost(16) == prefill + NEW_TOKENS * 2


def test_int4_where_it_is_fastest_at_one_row_and_close_at_many() -> None:
    """AVX-512: int4 22% cheaper alone, float16 1.5% cheaper at 16 (its faster prefill):
    the worst case decides, so int4."""
    choice = choose(ON_AVX512)
    assert choice.chosen is INT4
    assert choice.worst[INT4] < 1.02 and choice.worst[FLOAT16] > 1.15
    said = choice.reason()
    assert said.startswith("auto chose int4 by measurement on this CPU (")
    assert "int4: decode 1 row 14.6 ms, 16 rows 45.7 ms, prefill 64 tokens 110 ms" in said


def test_float16_where_int4s_kernel_is_slow_at_every_batch_size() -> None:
    """AVX2: aten's int4 kernel loses alone and at 16."""
    choice = choose(ON_AVX2)
    assert choice.chosen is FLOAT16 and choice.worst[FLOAT16] == 1.0


def test_the_first_candidate_stays_unless_another_is_clearly_better() -> None:
    """Timing noise must not flip the choice from start to start where the two are close."""
    close = {INT4: StepTimes(10.0, 30.0, 16, 50), FLOAT16: StepTimes(9.7, 29.1, 16, 48.5)}
    assert choose(close).chosen is INT4
    assert close[INT4].request_cost(1) / close[FLOAT16].request_cost(1) - 1 < MARGIN
    clear = {INT4: StepTimes(10.0, 30.0, 16, 50), FLOAT16: StepTimes(9.0, 27.0, 16, 45)}
    assert choose(clear).chosen is FLOAT16


def _projections(model: Decoder) -> list[torch.nn.Module]:
    return [
        layer.get_submodule(n)
        for layer in model.layers
        for n in ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.down")
    ]


@pytest.mark.parametrize(("times", "packed"), [(ON_AVX512, Int4Linear), (ON_AVX2, Float16Linear)])
def test_each_candidate_is_measured_on_the_model_and_the_chosen_one_is_served(
    monkeypatch: pytest.MonkeyPatch, times: dict[WeightDtype, StepTimes], packed: type
) -> None:
    """The measure sees the model packed as each candidate in turn (then put back as it
    was); the engine serves the one the times choose, and says why in its report."""
    from kvfence_engine.core import build

    seen = []

    def measure(rows: int):
        def timed(model: Decoder) -> StepTimes:
            kinds = {type(m) for m in _projections(model)}
            assert len(kinds) == 1, kinds
            kind = INT4 if kinds == {Int4Linear} else FLOAT16
            seen.append(kind)
            return times[kind]

        return timed

    monkeypatch.setattr(build, "step_times", measure)
    engine = LLMEngine(tiny_q4(), EngineArgs(kv_cache_memory=16 << 20))
    assert seen == [INT4, FLOAT16] * ROUNDS  # interleaved
    assert all(isinstance(m, packed) for m in _projections(engine.runner.model))
    report = engine.kvpool_report()
    assert report.weight_dtype == str(choose(times).chosen)
    assert report.weight_choice == choose(times).reason()


def test_load_from_outside_during_one_round_does_not_decide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another engine starting on the same cores slows whatever is measured meanwhile: each
    candidate keeps its fastest of the interleaved rounds, so a slow first round of float16
    (AVX2's winner) does not hand the choice to int4."""
    from kvfence_engine.core import build

    loaded = iter([StepTimes(60.0, 250.0, 16, 400)] + [ON_AVX2[FLOAT16]] * (ROUNDS - 1))

    def measure(rows: int):
        def timed(model: Decoder) -> StepTimes:
            if isinstance(model.layers[0].get_submodule("mlp.down"), Int4Linear):
                return ON_AVX2[INT4]
            return next(loaded)

        return timed

    monkeypatch.setattr(build, "step_times", measure)
    engine = LLMEngine(tiny_q4(), EngineArgs(kv_cache_memory=16 << 20))
    assert engine.precision.weights == FLOAT16
    assert engine.precision.why == choose(ON_AVX2).reason()


def test_auto_measures_the_real_steps_and_serves_what_it_chose() -> None:
    """No stand-in: the real measure runs the model's decode and prefill steps over a scratch
    pool of its own; the engine then serves as with the chosen dtype asked for by name."""
    engine = LLMEngine(tiny_q4(), EngineArgs(kv_cache_memory=16 << 20))
    chosen = engine.precision.weights
    assert chosen in (INT4, FLOAT16) and engine.precision.why is not None
    assert f"auto chose {chosen} by measurement" in engine.precision.why
    times = [float(x) for x in engine.precision.why.split() if x.replace(".", "").isdigit()]
    assert times and all(t >= 0 for t in times)
    named = LLMEngine(tiny_q4(), EngineArgs(kv_cache_memory=16 << 20, weight_dtype=chosen))
    prompt = prompt_of(20, seed=3)
    ours = generate(engine, prompt, 8, ignore_eos=True).output_ids
    assert ours == generate(named, prompt, 8, ignore_eos=True).output_ids
    assert engine.pages.num_used == 0  # the measurement's scratch pool is not the engine's
