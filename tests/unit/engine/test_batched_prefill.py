"""Prefill batching: waiting prompts are prefilled together, one flat batch of tokens per step
(each prompt attends only to itself), up to the max-batched-tokens budget."""

import pytest

from helpers.engines import generate, make_tiny_engine, prompt_of, submit


@pytest.mark.parametrize("weight_dtype", ["float32", "int8", "float16"])
def test_sixteen_waiting_prompts_are_prefilled_in_one_step(weight_dtype: str) -> None:
    prompts = [prompt_of(20 + 3 * i, seed=i) for i in range(16)]
    engine = make_tiny_engine(weight_dtype=weight_dtype)
    seqs = [submit(engine, p, 4, ignore_eos=True) for p in prompts]
    engine.step()
    assert [len(s.output_ids) for s in seqs] == [1] * 16
    assert not engine.scheduler.waiting and len(engine.scheduler.running) == 16
    # each prompt's first token is what it gets alone: no attention across prompts
    solo = make_tiny_engine(weight_dtype=weight_dtype)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_ids == generate(solo, prompt, 1).output_ids


def test_a_prefill_step_stops_at_the_batched_tokens_budget() -> None:
    engine = make_tiny_engine(max_batched_tokens=100)
    seqs = [submit(engine, prompt_of(40, seed=i), 4, ignore_eos=True) for i in range(5)]
    prefilled_per_step = []
    while engine.scheduler.waiting:
        before = sum(1 for s in seqs if s.output_ids)
        engine.step()
        prefilled_per_step.append(sum(1 for s in seqs if s.output_ids) - before)
    assert prefilled_per_step == [2, 2, 1]  # 2 x 40 tokens fit in 100, a third does not


def test_a_prompt_longer_than_the_budget_still_runs_alone() -> None:
    engine = make_tiny_engine(max_batched_tokens=32)
    long, short = prompt_of(50, seed=1), prompt_of(10, seed=2)
    seqs = [submit(engine, long, 2, ignore_eos=True), submit(engine, short, 2, ignore_eos=True)]
    engine.step()
    assert [len(s.output_ids) for s in seqs] == [1, 0]
