"""A step that raises fails exactly the requests of its batch, with a 500 in the OpenAI shape,
and returns their pages; every other request goes on and the engine keeps serving."""

import asyncio
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from fastapi.testclient import TestClient

from helpers.engines import make_tiny_engine, prompt_of, run_until_done, submit
from kvfence_engine.core import errors
from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.request import Request, SamplingParams, is_terminal
from kvfence_engine.core.runner import PreparedStep
from kvfence_engine.serving.app import create_app
from kvfence_engine.serving.async_engine import AsyncEngine
from kvfence_engine.serving.state import ServerState

PAGES = 64


class InjectedFault(RuntimeError):
    pass


@contextmanager
def failing_steps(
    engine: LLMEngine, when: Callable[[list[Request], bool], bool]
) -> Iterator[list[list[Request]]]:
    """Make the model's forward pass raise in every step whose batch `when` picks; yields the
    batches that failed."""
    prepare, run = engine.runner.prepare, engine.runner.run
    # keyed by id, holding the step itself so that no other step can take its id meanwhile
    batches: dict[int, tuple[PreparedStep, list[Request], bool]] = {}
    failed: list[list[Request]] = []

    def prepare_and_remember(seqs: list[Request], is_prefill: bool) -> PreparedStep:
        step = prepare(seqs, is_prefill)
        batches[id(step)] = (step, list(seqs), is_prefill)
        return step

    def run_or_fail(step: PreparedStep) -> torch.Tensor:
        # a step the engine thread prepared before this was installed runs as it would have
        _, seqs, is_prefill = batches.pop(id(step), (step, [], False))
        if seqs and when(seqs, is_prefill):
            failed.append(seqs)
            raise InjectedFault("injected: the forward pass failed")
        return run(step)

    engine.runner.prepare = prepare_and_remember  # type: ignore[method-assign]
    engine.runner.run = run_or_fail  # type: ignore[method-assign]
    try:
        yield failed
    finally:
        engine.runner.prepare, engine.runner.run = prepare, run  # type: ignore[method-assign]


def _is_internal_error(seq: Request) -> bool:
    error = seq.error
    return (
        seq.finish_reason == "error"
        and error is not None
        and (error.status, error.type, error.code) == (500, "server_error", "internal_error")
    )


def test_a_failing_prefill_batch_fails_only_its_requests_and_returns_their_pages() -> None:
    engine = make_tiny_engine(pages=PAGES)
    running = [submit(engine, prompt_of(20, seed=i), 12, ignore_eos=True) for i in range(2)]
    engine.step()  # their prefill: both decode from now on
    victims = [submit(engine, prompt_of(40, seed=10 + i), 12, ignore_eos=True) for i in range(2)]
    with failing_steps(engine, lambda _seqs, is_prefill: is_prefill) as failed:
        changed = engine.step()  # the prefill of the victims: it raises
    assert failed == [victims]
    assert all(_is_internal_error(seq) for seq in victims)
    assert set(victims) <= set(changed)  # reported, so their streams hear of it
    # the failed batch's pages came back with the step: only the bystanders hold any
    assert engine.pages.num_used == sum(len(seq.pages) for seq in running)
    run_until_done(engine)
    assert [seq.finish_reason for seq in running] == ["length", "length"]
    assert all(len(seq.output_ids) == 12 for seq in running)
    assert engine.pages.num_free == PAGES
    later = submit(engine, prompt_of(30, seed=99), 4, ignore_eos=True)
    run_until_done(engine)
    assert later.finish_reason == "length" and engine.pages.num_free == PAGES


def test_a_failing_decode_batch_fails_only_its_requests_and_the_waiting_ones_run() -> None:
    engine = make_tiny_engine(pages=PAGES)
    victims = [submit(engine, prompt_of(20, seed=i), 12, ignore_eos=True) for i in range(2)]
    engine.step()
    with failing_steps(engine, lambda _seqs, is_prefill: not is_prefill) as failed:
        engine.step()
    assert failed == [victims]
    assert all(_is_internal_error(seq) for seq in victims)
    assert engine.pages.num_used == 0 and not engine.has_work()
    after = submit(engine, prompt_of(20, seed=5), 6, ignore_eos=True)
    run_until_done(engine)
    assert after.finish_reason == "length" and len(after.output_ids) == 6
    assert engine.pages.num_free == PAGES


def test_a_step_failure_names_no_internals_and_is_counted() -> None:
    engine = make_tiny_engine(pages=PAGES)
    victim = submit(engine, prompt_of(8), 4)
    with failing_steps(engine, lambda _seqs, _prefill: True):
        engine.step()
    assert victim.error is not None
    assert re.fullmatch(r"internal error \(incident [0-9a-f]{16}\)", victim.error.message)
    failures = engine.metrics.registry.get_sample_value("kvfence_engine_step_failures_total")
    assert failures == 1


def test_a_finish_decided_by_a_step_that_then_failed_is_void() -> None:
    """A one-token request finishes ("length") inside its prefill step; when that step fails
    afterwards (here, copying its KV out), the request is failed too, not reported done."""
    engine = make_tiny_engine(pages=PAGES)
    seq = submit(engine, prompt_of(8), 1, ignore_eos=True)
    seq.export_kv = True  # as the prefill role asks: its KV is copied out after sampling

    def broken(seq: Request, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise InjectedFault("injected: after sampling")

    engine.pages.export = broken  # type: ignore[method-assign]
    assert seq in engine.step()
    assert _is_internal_error(seq) and engine.pages.num_free == PAGES


def test_a_scheduled_prefill_is_always_in_a_queue_so_a_failure_after_schedule_returns_its_pages():
    """From the moment the scheduler picks a prefill batch it is in `running`: a failure outside
    any batch right after scheduling (the engine loop then fails every queued request) still
    finds the batch, answers it and returns its pages."""
    engine = make_tiny_engine(pages=PAGES)
    seqs = [submit(engine, prompt_of(30, seed=i), 4, ignore_eos=True) for i in range(3)]
    batch, is_prefill = engine.scheduler.schedule()
    assert is_prefill and batch == seqs
    assert list(engine.scheduler.running) == seqs and not engine.scheduler.waiting
    assert engine.pages.num_used == 3 * 2
    failed = engine.fail_all(errors.internal_error("incident 0123456789abcdef"))
    assert failed == seqs and all(_is_internal_error(seq) for seq in seqs)
    assert engine.pages.num_free == PAGES and not engine.has_work()


async def _collect(engine: AsyncEngine, seq: Request) -> Request:
    async for _ in engine.stream(seq):
        pass
    return seq


def _admit(engine: LLMEngine, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    seq = engine.admit(prompt, params, max_tokens=max_tokens)
    assert not is_terminal(seq)
    return seq


def test_the_engine_thread_answers_a_failed_prefill_batch_and_serves_everyone_else() -> None:
    """Through the engine thread (what the HTTP server uses): bystanders already decoding
    finish normally, the failed prefill batch's streams end with a 500, no page leaks, and a
    later request is served."""
    llm = make_tiny_engine(pages=PAGES)
    engine = AsyncEngine(llm)
    engine.start()

    async def scenario() -> None:
        bystanders = [_admit(llm, prompt_of(20, seed=i), 40) for i in range(2)]
        streams = [engine.stream(seq) for seq in bystanders]
        for stream in streams:  # both are decoding before the victims arrive
            await anext(stream)
        victims = {_admit(llm, prompt_of(30, seed=10 + i), 8) for i in range(3)}
        with failing_steps(llm, lambda seqs, _: bool(victims & set(seqs))) as failed:
            await asyncio.wait_for(
                asyncio.gather(*(_collect(engine, seq) for seq in victims)), timeout=30
            )
        assert failed and all(set(batch) <= victims for batch in failed)
        assert all(_is_internal_error(seq) for seq in victims)
        for stream in streams:
            async for _ in stream:
                pass
        assert [seq.finish_reason for seq in bystanders] == ["length", "length"]
        assert all(len(seq.output_ids) == 40 for seq in bystanders)
        assert await engine.call(lambda: llm.pages.num_free) == PAGES
        later = await asyncio.wait_for(_collect(engine, _admit(llm, prompt_of(9), 3)), 30)
        assert later.finish_reason == "length"
        assert await engine.call(lambda: llm.pages.num_free) == PAGES

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_a_failure_outside_any_batch_fails_the_queued_requests_and_the_engine_goes_on() -> None:
    llm = make_tiny_engine(pages=PAGES)
    schedule = llm.scheduler.schedule
    calls = 0

    def schedule_failing_once() -> tuple[list[Request], bool]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise InjectedFault("injected: the scheduler broke")
        return schedule()

    llm.scheduler.schedule = schedule_failing_once  # type: ignore[method-assign]
    engine = AsyncEngine(llm)
    engine.start()

    async def scenario() -> None:
        queued = await asyncio.wait_for(_collect(engine, _admit(llm, prompt_of(9), 3)), 30)
        assert _is_internal_error(queued)
        later = await asyncio.wait_for(_collect(engine, _admit(llm, prompt_of(9), 3)), 30)
        assert later.finish_reason == "length"
        assert await engine.call(lambda: llm.pages.num_free) == PAGES

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_a_failing_housekeeping_chore_fails_no_request() -> None:
    llm = make_tiny_engine(pages=PAGES)
    engine = AsyncEngine(llm)

    def broken_chore(_now: float) -> None:
        raise InjectedFault("injected: a chore broke")

    engine.housekeeping.append(broken_chore)
    engine.start()

    async def scenario() -> None:
        seq = await asyncio.wait_for(_collect(engine, _admit(llm, prompt_of(9), 5)), 30)
        assert seq.finish_reason == "length" and len(seq.output_ids) == 5

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_a_stream_whose_event_loop_is_gone_is_aborted_and_fails_nobody_else() -> None:
    """Delivering to a closed event loop raises; that must cost only the orphaned request
    (aborted, pages back), not every request in the scheduler."""
    llm = make_tiny_engine(pages=PAGES)
    engine = AsyncEngine(llm)
    engine.start()
    orphan = _admit(llm, prompt_of(20, seed=1), 200)
    gone = asyncio.new_event_loop()
    try:
        stream = engine.stream(orphan)
        gone.run_until_complete(anext(stream))
    finally:
        gone.close()  # without closing the stream: nobody reads it any more

    async def scenario() -> None:
        bystander = await asyncio.wait_for(_collect(engine, _admit(llm, prompt_of(9), 30)), 30)
        assert bystander.finish_reason == "length" and len(bystander.output_ids) == 30
        assert await engine.call(lambda: orphan.finish_reason) == "abort"
        assert await engine.call(lambda: llm.pages.num_free) == PAGES

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


@pytest.fixture
def served() -> Iterator[tuple[TestClient, LLMEngine]]:
    llm = make_tiny_engine(pages=PAGES)
    engine = AsyncEngine(llm)
    engine.start()
    state = ServerState(engine=engine)
    try:
        with TestClient(create_app(state)) as client:
            yield client, llm
    finally:
        engine.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_over_http_a_failed_step_is_a_json_500_and_the_next_request_is_served(
    served: tuple[TestClient, LLMEngine], path: str, stream: bool
) -> None:
    client, llm = served
    body: dict[str, object] = {"max_tokens": 4, "stream": stream}
    if path == "/v1/completions":
        body["prompt"] = "Tenant isolation"
    else:
        body["messages"] = [{"role": "user", "content": "Tenant isolation"}]
    with failing_steps(llm, lambda _seqs, _prefill: True):
        r = client.post(path, json=body)
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert set(error) == {"message", "type", "param", "code"}
    assert "injected" not in error["message"]
    assert llm.pages.num_free == PAGES
    ok = client.post(path, json=body)
    assert ok.status_code == 200, ok.text
    assert llm.pages.num_free == PAGES
