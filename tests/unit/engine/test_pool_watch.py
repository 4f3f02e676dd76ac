"""Negative controls for the pool-whole invariant (tests/helpers/pool_watch.py): a test that
leaves pages held is named, with how many pages are missing; one that frees them is not."""

from helpers import pool_watch
from helpers.engines import make_tiny_engine, prompt_of, submit
from kvfence_engine.core.request import Request, SamplingParams


def test_pages_a_test_leaves_allocated_are_reported_as_leaked() -> None:
    before = pool_watch.snapshot()
    engine = make_tiny_engine(pages=8)
    seq = Request(99, prompt_of(48), SamplingParams(max_tokens=1))
    assert engine.pages.allocate(seq)  # 3 pages, never released
    assert pool_watch.leaks(before) == [
        "in-process engine (combined): 5 free pages of 8, 8 at the start"
    ]
    engine.pages.deallocate(seq)
    assert pool_watch.leaks(before) == []


def test_requests_a_test_leaves_running_are_finished_before_judging() -> None:
    before = pool_watch.snapshot()
    engine = make_tiny_engine(pages=8)
    submit(engine, prompt_of(30), max_tokens=4)
    assert engine.has_work() and engine.pages.num_free == 8  # queued; its pages come at its step
    engine.step()
    assert engine.pages.num_free < 8
    assert pool_watch.leaks(before) == []  # drained: the request finished and freed its pages
