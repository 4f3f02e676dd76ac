"""Continuous batching gives every request the tokens it would get alone."""

from helpers.engines import generate, make_tiny_engine, prompt_of, run_until_done, submit


def _alone(prompt: list[int], max_tokens: int) -> list[int]:
    return generate(make_tiny_engine(), prompt, max_tokens, ignore_eos=True).output_ids


def test_concurrent_requests_of_different_lengths_match_their_solo_runs() -> None:
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 33, 64, 90)]
    engine = make_tiny_engine()
    seqs = [submit(engine, p, 12, ignore_eos=True) for p in prompts]
    run_until_done(engine)
    assert [s.output_ids for s in seqs] == [_alone(p, 12) for p in prompts]
    assert engine.pages.num_used == 0


def test_requests_arriving_mid_decode_join_without_disturbing_others() -> None:
    engine = make_tiny_engine()
    first = submit(engine, prompt_of(20, seed=1), 10, ignore_eos=True)
    for _ in range(4):
        engine.step()
    second = submit(engine, prompt_of(30, seed=2), 10, ignore_eos=True)
    run_until_done(engine)
    assert first.output_ids == _alone(prompt_of(20, seed=1), 10)
    assert second.output_ids == _alone(prompt_of(30, seed=2), 10)


def test_a_pool_too_small_for_everyone_preempts_and_still_finishes_everything() -> None:
    engine = make_tiny_engine(pages=8)  # 128 slots for 4 x (40 + 30) tokens
    prompts = [prompt_of(40, seed=i) for i in range(4)]
    seqs = [submit(engine, p, 30, ignore_eos=True) for p in prompts]
    run_until_done(engine)
    preemptions = engine.metrics.registry.get_sample_value("kvfence_preemptions_total")
    assert preemptions is not None and preemptions > 0
    assert [s.output_ids for s in seqs] == [_alone(p, 30) for p in prompts]
    assert engine.pages.num_used == 0


def test_an_aborted_request_returns_its_pages() -> None:
    engine = make_tiny_engine()
    seq = submit(engine, prompt_of(50), 100, ignore_eos=True)
    engine.step()
    assert engine.pages.num_used == 4
    engine.abort(seq)
    engine.step()
    assert seq.finish_reason == "abort" and engine.pages.num_used == 0


def test_seeded_sampling_repeats_and_different_seeds_differ() -> None:
    def run(seed: int) -> list[int]:
        engine = make_tiny_engine()
        return generate(
            engine, prompt_of(10), 20, temperature=1.0, seed=seed, ignore_eos=True
        ).output_ids

    assert run(1) == run(1)
    assert run(1) != run(2)
