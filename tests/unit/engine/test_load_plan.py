"""A model load's named steps, known before it starts (what `kvfence serve` counts on
/readyz, and `kvfence up` shows): planned from the source and the cache, nothing loaded, and
told in that order as the load runs."""

from pathlib import Path

import pytest

from kvfence_engine.loading.loader import SAVE_STEP, convert_steps, plan_load
from kvfence_engine.loading.tokenizer_source import SMOLLM2, TINY_RANDOM, smollm2_gguf_path


def test_a_first_start_of_a_gguf_plans_its_conversion_and_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path))  # empty: nothing converted yet
    name = smollm2_gguf_path().name
    assert plan_load(SMOLLM2).steps == (
        f"reading {name} (header and vocabulary)",
        "dequantizing the weights",
        "building the tokenizer",
        SAVE_STEP,
    )
    assert list(tmp_path.iterdir()) == []  # planned, not loaded


def test_with_the_weights_cache_off_nothing_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVFENCE_WEIGHTS_CACHE", "off")
    assert plan_load(SMOLLM2).steps == convert_steps(smollm2_gguf_path())


def test_the_steps_are_told_in_order_as_the_load_runs() -> None:
    plan = plan_load(TINY_RANDOM)
    told: list[str] = []
    loaded = plan.run(told.append)
    assert told == list(plan.steps) == ["generating the tiny random weights"]
    assert loaded.source == TINY_RANDOM


def test_a_source_that_does_not_resolve_is_refused_when_planned() -> None:
    with pytest.raises(ValueError, match="builtin:nope"):
        plan_load("builtin:nope")
