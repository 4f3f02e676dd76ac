"""Admission: over-limit prompts are refused before any page is allocated."""

import pytest

from helpers.engines import generate, make_tiny_engine, prompt_of, run_until_done, submit
from kvfence_engine.core.faults import Fault, Faults, UnsafeFaultRefused
from kvfence_engine.core.pool_plan import ContextPolicy
from kvfence_engine.core.request import is_terminal

CONTEXT = 128


@pytest.mark.parametrize("length", [CONTEXT + 1, 2 * CONTEXT])
def test_a_prompt_over_the_context_gets_400_and_allocates_no_page(length: int) -> None:
    engine = make_tiny_engine(context_length=CONTEXT)
    used_before = engine.pages.num_used
    seq = submit(engine, prompt_of(length))
    assert is_terminal(seq) and seq.finish_reason == "error"
    assert seq.error is not None and seq.error.status == 400
    assert seq.error.code == "context_length_exceeded"
    assert engine.pages.num_used == used_before
    assert not engine.has_work()
    rejected = engine.metrics.registry.get_sample_value(
        "kvfence_requests_rejected_total", {"reason": "context_length_exceeded"}
    )
    assert rejected == 1


def test_a_prompt_one_under_the_context_is_served_and_its_pages_come_back() -> None:
    engine = make_tiny_engine(context_length=CONTEXT)
    seq = generate(engine, prompt_of(CONTEXT - 1), max_tokens=8)
    assert seq.error is None
    assert seq.finish_reason in ("length", "stop")
    # prompt + generated may hold at most CONTEXT KV slots: 2 tokens fit after CONTEXT-1
    assert len(seq.output_ids) <= 2
    assert engine.pages.num_used == 0


def test_a_prompt_exactly_at_the_context_gets_one_token() -> None:
    engine = make_tiny_engine(context_length=CONTEXT)
    seq = generate(engine, prompt_of(CONTEXT), max_tokens=50, ignore_eos=True)
    assert seq.error is None and len(seq.output_ids) == 1 and seq.finish_reason == "length"
    assert engine.pages.num_used == 0  # finished in its prefill step: its pages still return


def test_max_tokens_is_clamped_to_the_room_left_in_the_context() -> None:
    engine = make_tiny_engine(context_length=CONTEXT)
    seq = generate(engine, prompt_of(100), max_tokens=1000, ignore_eos=True)
    assert len(seq.output_ids) == CONTEXT - 100 + 1
    assert seq.finish_reason == "length"


def test_max_tokens_below_one_is_a_400() -> None:
    engine = make_tiny_engine()
    seq = submit(engine, prompt_of(4), max_tokens=0)
    assert seq.error is not None and seq.error.status == 400 and seq.error.param == "max_tokens"


def test_an_empty_prompt_is_a_400() -> None:
    seq = submit(make_tiny_engine(), [])
    assert seq.error is not None and seq.error.status == 400


def test_refuse_policy_keeps_the_context_but_rejects_what_the_pool_cannot_hold() -> None:
    engine = make_tiny_engine(pages=4, context_length=256)  # pool: 64 tokens
    assert engine.context_effective == 256
    assert engine.kvpool_report().pool_tokens == 64
    seq = submit(engine, prompt_of(65))
    assert seq.error is not None and seq.error.code == "context_length_exceeded"
    assert "KV pool" in seq.error.message
    assert engine.pages.num_used == 0


def test_lower_policy_serves_the_pool_rounded_down_to_a_page() -> None:
    engine = make_tiny_engine(pages=5, context_length=300, context_policy=ContextPolicy.LOWER)
    assert engine.context_effective == 80
    report = engine.kvpool_report()
    assert report.context_length_requested == 300
    assert report.context_length_effective == 80
    assert submit(engine, prompt_of(81)).error is not None


def test_a_full_waiting_queue_answers_503_with_retry_after() -> None:
    engine = make_tiny_engine(max_waiting=2)
    for _ in range(2):
        assert submit(engine, prompt_of(8)).error is None
    seq = submit(engine, prompt_of(8))
    assert seq.error is not None and seq.error.status == 503 and seq.error.retry_after
    run_until_done(engine)
    assert engine.pages.num_used == 0


def test_a_context_beyond_the_models_positions_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="exceeds the model's"):
        make_tiny_engine(context_length=100_000)


def test_a_budget_smaller_than_one_page_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="holds no page"):
        make_tiny_engine(pages=0)


def test_unsafe_faults_are_refused_without_the_environment_switch() -> None:
    with pytest.raises(UnsafeFaultRefused, match="KVFENCE_ALLOW_UNSAFE"):
        Faults.from_names(["no-tag-check"], environ={})
    with pytest.raises(UnsafeFaultRefused, match="unknown"):
        Faults.from_names(["zero-everything"], environ={"KVFENCE_ALLOW_UNSAFE": "1"})


def test_a_fault_asked_for_by_a_bare_string_is_an_error_not_a_silently_disabled_check() -> None:
    faults = Faults.from_names(["late-write"], environ={"KVFENCE_ALLOW_UNSAFE": "1"})
    assert Fault.LATE_WRITE in faults and Fault.NO_TAG_CHECK not in faults
    # a typo would otherwise read as "fault off", and the check it guards would quietly vanish
    with pytest.raises(TypeError, match="late-wirte"):
        _ = "late-wirte" in faults
    with pytest.raises(TypeError):  # even the right spelling: only Fault members are asked
        _ = "late-write" in faults


def test_fault_names_are_the_documented_unsafe_fault_names() -> None:
    assert [str(fault) for fault in Fault] == [
        "no-tag-check",
        "reject-placeholder",
        "early-release",
        "late-write",
        "skip-count-check",
        "cross-tenant-prefix",
        "shared-cache-eviction",
        "rank-desync",
    ]
    assert all(fault.description for fault in Fault)
