"""Each in-engine bug class, switched on: the read check fails the request closed, and with the
check switched off too, the test shows the foreign KV was really read (the negative control)."""

from typing import Unpack

import pytest
import torch

from helpers.engines import (
    TinyEngineOptions,
    generate,
    make_tiny_engine,
    prompt_of,
    run_until_done,
    submit,
)

CONTEXT = 128
OVER = 200  # over the context, within the 1024-token pool


@pytest.fixture(params=["host", pytest.param("device", marks=pytest.mark.slow)])
def decode(request: pytest.FixtureRequest) -> TinyEngineOptions:
    """Where decode steps check their reads: core/isolation on the host, or the device kernels
    of a GPU (core/device_decode; here in Triton's interpreter, no graphs: slow)."""
    if request.param == "host":
        return {}
    return {"device_decode": True, "enforce_eager": True}


def _pollute(engine, seed: int) -> None:
    """Another tenant's requests fill more pages than the victim will reserve, then finish;
    their pages go back to the free list unscrubbed."""
    seqs = [submit(engine, prompt_of(120, seed=seed * 10 + i), max_tokens=4) for i in range(2)]
    run_until_done(engine)
    assert all(s.error is None for s in seqs) and engine.pages.num_used == 0


def _placeholder_victim(
    faults: tuple[str, ...], polluter_seed: int, **decode: Unpack[TinyEngineOptions]
):
    engine = make_tiny_engine(faults=faults, **(decode | {"context_length": CONTEXT}))
    _pollute(engine, polluter_seed)
    seq = generate(engine, prompt_of(OVER, seed=99), max_tokens=6, ignore_eos=True, logprobs=0)
    return engine, seq


def test_reject_placeholder_fails_closed_with_the_unwritten_read_counter(
    decode: TinyEngineOptions,
) -> None:
    engine, seq = _placeholder_victim(("reject-placeholder",), polluter_seed=1, **decode)
    assert seq.error is not None and seq.error.status == 500
    assert seq.error.code == "kv_isolation_violation"
    assert engine.metrics.registry.get_sample_value("kvfence_kv_unwritten_read_total") == 1
    assert len(seq.output_ids) == 1  # the placeholder's token; nothing read from foreign KV
    assert engine.pages.num_used == 0


def test_without_the_fault_the_same_prompt_is_a_400_and_allocates_nothing() -> None:
    engine, seq = _placeholder_victim((), polluter_seed=1)
    assert seq.error is not None and seq.error.status == 400
    assert engine.metrics.registry.get_sample_value("kvfence_kv_unwritten_read_total") == 0


def test_reject_placeholder_without_tag_check_reads_the_other_tenants_kv(
    decode: TinyEngineOptions,
) -> None:
    faults = ("reject-placeholder", "no-tag-check")
    _, after_a = _placeholder_victim(faults, polluter_seed=1, **decode)
    _, after_a_again = _placeholder_victim(faults, polluter_seed=1, **decode)
    _, after_b = _placeholder_victim(faults, polluter_seed=2, **decode)
    assert after_a.error is None and after_b.error is None  # a 200 with wrong content
    lp = lambda s: torch.tensor([x.logprob for x in s.output_logprobs])  # noqa: E731
    assert torch.equal(lp(after_a), lp(after_a_again))  # deterministic given the same pool
    # ... so any difference comes from whose data was left in the pages it read.
    assert (lp(after_a) - lp(after_b)).abs().max() > 1e-3


def _early_release_victim(
    faults: tuple[str, ...], intruder_seed: int, **decode: Unpack[TinyEngineOptions]
):
    engine = make_tiny_engine(faults=faults, **decode)
    victim = submit(engine, prompt_of(40, seed=5), max_tokens=12, ignore_eos=True, logprobs=0)
    engine.step()  # victim prefilled; the fault hands its first page back to the free list
    intruder = submit(engine, prompt_of(40, seed=intruder_seed), max_tokens=2, ignore_eos=True)
    run_until_done(engine)
    return engine, victim, intruder


def test_early_release_robbed_page_goes_to_another_owner_not_back_to_the_victim() -> None:
    """The fault must not race: the victim's next page boundary comes before the intruder
    arrives, yet the victim gets a different page and the intruder gets the robbed one."""
    engine = make_tiny_engine(faults=("early-release", "no-tag-check"))
    victim = submit(engine, prompt_of(48, seed=5), max_tokens=12, ignore_eos=True, logprobs=0)
    engine.step()  # prefilled its 3 full pages; the fault hands the first one back
    robbed = victim.pages[0]
    engine.step()  # its first decode writes position 48: the victim allocates a 4th page
    assert len(victim.pages) == 4 and robbed not in victim.pages[1:]
    intruder = submit(engine, prompt_of(40, seed=6), max_tokens=2, ignore_eos=True)
    engine.step()
    assert robbed in intruder.pages  # (the fault robs the intruder's first page in turn)
    run_until_done(engine)
    assert victim.error is None and intruder.error is None
    assert engine.pages.num_used == 0


def test_early_release_fails_closed_with_the_tag_mismatch_counter(
    decode: TinyEngineOptions,
) -> None:
    engine, victim, intruder = _early_release_victim(("early-release",), 6, **decode)
    assert victim.error is not None and victim.error.code == "kv_isolation_violation"
    assert engine.metrics.registry.get_sample_value("kvfence_kv_tag_mismatch_total") >= 1
    assert intruder.error is None
    assert engine.pages.num_used == 0  # the stale release of the reassigned page was ignored


def test_early_release_without_tag_check_reads_the_intruders_kv(decode: TinyEngineOptions) -> None:
    faults = ("early-release", "no-tag-check")
    _, v1, _ = _early_release_victim(faults, 6, **decode)
    _, v1_again, _ = _early_release_victim(faults, 6, **decode)
    _, v2, _ = _early_release_victim(faults, 7, **decode)
    assert v1.error is None and v2.error is None
    lp = lambda s: torch.tensor([x.logprob for x in s.output_logprobs])  # noqa: E731
    assert torch.equal(lp(v1), lp(v1_again))
    assert (lp(v1) - lp(v2)).abs().max() > 1e-3


def test_without_faults_other_tenants_pollution_changes_nothing() -> None:
    """The positive control: with correct bookkeeping, pool contents left by others are
    invisible: the same prompt gets bit-identical logprobs whoever used the pages before."""
    outputs = []
    for seed in (1, 2):
        engine = make_tiny_engine(context_length=CONTEXT)
        _pollute(engine, seed)
        seq = generate(engine, prompt_of(100, seed=99), max_tokens=6, ignore_eos=True, logprobs=0)
        outputs.append([x.logprob for x in seq.output_logprobs])
    assert outputs[0] == outputs[1]
