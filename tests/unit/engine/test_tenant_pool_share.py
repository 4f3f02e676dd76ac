"""--max-pool-share-per-tenant: no tenant's requests reserve more than its share of the KV pool.

A request reserves its worst case (prompt + max_tokens) when the engine takes it; one that
would take its tenant over the share gets 429 tenant_pool_share with Retry-After before any
page is allocated, while other tenants still get pages; every reservation comes back however
the request ends."""

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from fastapi.testclient import TestClient

from helpers.engines import make_tiny_engine, prompt_of, run_until_done
from helpers.pool_watch import watch_reservations
from kvfence_engine.contracts import Role
from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import Request, SamplingParams, TokenLogprob, is_terminal
from kvfence_engine.core.runner import PreparedStep
from kvfence_engine.disagg.internal_api import internal_router
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.serving.app import create_app
from kvfence_engine.serving.async_engine import AsyncEngine
from kvfence_engine.serving.state import ServerState

PAGES = 16
PAGE = 16  # make_tiny_engine's page size
SHARE = 0.5  # 8 pages, 128 tokens per tenant
# 64 prompt tokens + 33 max_tokens -> 96 slots: 6 pages reserved; two of them are 12 > 8
PROMPT, MAX_TOKENS, FOOTPRINT = 64, 33, 6


def engine_with_share(share: float = SHARE, role: str = "combined") -> LLMEngine:
    return make_tiny_engine(pages=PAGES, max_pool_share_per_tenant=share, role=role)


def admit(
    engine: LLMEngine, tenant: str, max_tokens: int | None = MAX_TOKENS, length: int = PROMPT
) -> Request:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    return engine.admit(prompt_of(length), params, max_tokens=max_tokens, tenant=tenant)


def started(engine: LLMEngine, tenant: str) -> Request:
    seq = admit(engine, tenant)
    assert not is_terminal(seq), seq.error
    engine.add(seq)
    return seq


def assert_share_refusal(error: EngineError | None) -> None:
    assert error is not None
    assert (error.status, error.type, error.code) == (429, "tokens", "tenant_pool_share")
    assert error.retry_after == 1
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def test_a_tenant_over_its_share_gets_429_while_another_tenant_still_gets_pages() -> None:
    engine = engine_with_share()
    first = started(engine, "team-a")
    engine.step()  # first's prompt is in the pool now
    used = engine.pages.num_used

    over = admit(engine, "team-a")
    assert is_terminal(over) and over.finish_reason == "error"
    assert_share_refusal(over.error)
    assert engine.pages.num_used == used  # refused before any page was allocated
    rejected = engine.metrics.registry.get_sample_value(
        "kvfence_requests_rejected_total", {"reason": "tenant_pool_share"}
    )
    assert rejected == 1

    other = started(engine, "team-b")
    run_until_done(engine)
    assert other.error is None and len(other.output_ids) == MAX_TOKENS
    assert first.error is None and len(first.output_ids) == MAX_TOKENS
    # its first request finished: the share is free again
    again = started(engine, "team-a")
    run_until_done(engine)
    assert again.error is None
    assert engine.shares.by_tenant() == {}


def test_without_a_share_the_same_requests_are_all_admitted() -> None:
    """The negative control: the default share (1.0) caps nothing."""
    engine = engine_with_share(1.0)
    seqs = [started(engine, "team-a") for _ in range(2)]
    run_until_done(engine)
    assert all(s.error is None and len(s.output_ids) == MAX_TOKENS for s in seqs)


def test_two_requests_admitted_together_cannot_both_take_the_share() -> None:
    """Admission checks from request threads; the engine thread reserves when it takes the
    request, and refuses the second one there, still before any page."""
    engine = engine_with_share()
    a, b = admit(engine, "team-a"), admit(engine, "team-a")
    assert not is_terminal(a) and not is_terminal(b)
    engine.add(a)
    with pytest.raises(EngineError) as refused:
        engine.add(b)
    assert_share_refusal(refused.value)
    assert engine.shares.by_tenant() == {"team-a": FOOTPRINT}
    run_until_done(engine)


def test_a_request_that_could_never_fit_the_share_is_a_400_not_a_retry() -> None:
    engine = engine_with_share()
    cap_tokens = int(PAGES * SHARE) * PAGE
    too_long = admit(engine, "team-a", max_tokens=8, length=cap_tokens + 1)
    assert too_long.error is not None and too_long.error.status == 400
    too_many = admit(engine, "team-a", max_tokens=cap_tokens)
    assert too_many.error is not None and too_many.error.status == 400
    assert too_many.error.param == "max_tokens"
    assert f"at most {cap_tokens - PROMPT + 1}" in too_many.error.message
    # a max_tokens left to the engine shrinks to what the share holds
    unset = admit(engine, "team-a", max_tokens=None)
    assert not is_terminal(unset)
    assert unset.params.max_tokens == cap_tokens - PROMPT + 1
    engine.add(unset)
    run_until_done(engine)
    assert unset.error is None and len(unset.output_ids) == cap_tokens - PROMPT + 1


def test_the_combined_role_caps_its_one_tenant() -> None:
    """Without a tenant named (a combined engine's own clients), requests are 'default''s."""
    engine = engine_with_share()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    first = engine.admit(prompt_of(PROMPT), params, max_tokens=MAX_TOKENS)
    engine.add(first)
    second = engine.admit(prompt_of(PROMPT), params, max_tokens=MAX_TOKENS)
    assert_share_refusal(second.error)
    assert engine.shares.by_tenant() == {"default": FOOTPRINT}
    run_until_done(engine)


def test_reservations_come_back_to_zero_after_finished_aborted_and_failed_requests() -> None:
    engine = engine_with_share(1.0)
    done = started(engine, "a")
    aborted_waiting = started(engine, "b")
    engine.abort(aborted_waiting)  # before it ever ran
    run_until_done(engine)
    running = started(engine, "c")
    engine.step()
    engine.abort(running)  # mid-decode
    failing = started(engine, "d")
    run = engine.runner.run

    def fail_once(step: PreparedStep) -> torch.Tensor:
        engine.runner.run = run  # type: ignore[method-assign]
        raise RuntimeError("injected: the forward pass failed")

    engine.runner.run = fail_once  # type: ignore[method-assign]
    run_until_done(engine)
    assert done.error is None
    assert failing.error is not None and failing.error.status == 500
    assert running.finish_reason == "abort" and aborted_waiting.finish_reason == "abort"
    assert engine.shares.by_tenant() == {}
    assert engine.metrics.registry.get_sample_value("kvfence_tenant_kv_pages_reserved") is None
    assert engine.pages.num_free == PAGES


def test_a_preempted_request_keeps_its_reservation() -> None:
    """Preemption releases pages, not the request's claim on its share."""
    engine = engine_with_share(1.0)
    seqs = [started(engine, f"t{i}") for i in range(3)]  # 18 pages reserved on a 16-page pool
    for _ in range(PROMPT):
        engine.step()
        if engine.metrics.registry.get_sample_value("kvfence_preemptions_total"):
            break
    else:
        pytest.fail("no request was preempted")
    assert engine.shares.by_tenant() == {f"t{i}": FOOTPRINT for i in range(3)}
    run_until_done(engine)
    assert all(s.error is None for s in seqs)
    assert engine.shares.by_tenant() == {}


def test_the_reserved_pages_per_tenant_are_a_metric() -> None:
    engine = engine_with_share()
    started(engine, "team-a")
    value = engine.metrics.registry.get_sample_value(
        "kvfence_tenant_kv_pages_reserved", {"tenant": "team-a"}
    )
    assert value == FOOTPRINT
    run_until_done(engine)


# --- decode role: reservations, and through the internal API ---------------------------------


def test_a_decode_reservation_reserves_the_share_and_gives_it_back_when_dropped() -> None:
    engine = engine_with_share(role="decode")
    book = watch_reservations(DecodeReservations(engine))
    seq, over = admit(engine, "team-a"), admit(engine, "team-a")  # admitted together
    book.reserve(seq, "team-a-1")
    assert engine.shares.by_tenant() == {"team-a": FOOTPRINT}
    assert_share_refusal(admit(engine, "team-a").error)
    with pytest.raises(EngineError) as refused:
        book.reserve(over, "team-a-2")
    assert_share_refusal(refused.value)
    assert book.abort("team-a-1") is seq
    assert engine.shares.by_tenant() == {}
    expiring = admit(engine, "team-a")
    book.reserve(expiring, "team-a-3")
    book.expire(float("inf"))
    assert engine.shares.by_tenant() == {}
    finishing = admit(engine, "team-a", max_tokens=1)
    book.reserve(finishing, "team-a-4")
    inbound = finishing.inbound
    assert inbound is not None
    inbound.done, inbound.written_tokens = True, inbound.reserved_tokens
    book.start_decode("team-a-4", TokenLogprob(7, 0.0))  # max_tokens 1: finished at once
    assert engine.shares.by_tenant() == {} and engine.pages.num_free == PAGES


@contextmanager
def decode_app(share: float) -> Iterator[tuple[TestClient, LLMEngine]]:
    llm = engine_with_share(share, role="decode")
    state = ServerState(role=Role.DECODE)
    app = create_app(state)
    app.include_router(internal_router(state))
    state.load_in_background(lambda metrics: AsyncEngine(llm))
    deadline = time.monotonic() + 10
    while state.engine is None and state.load_error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.engine is not None, state.load_error
    try:
        with TestClient(app) as client:
            yield client, llm
    finally:
        state.engine.stop()
        for seq in llm.scheduler.queued():  # reservations the test left: as on expiry
            llm.abort(seq)


def reserve_body(request_id: str, tenant: str | None) -> dict[str, object]:
    body: dict[str, object] = {
        "request_id": request_id,
        "prompt_ids": prompt_of(PROMPT),
        "max_tokens": MAX_TOKENS,
    }
    return body if tenant is None else body | {"tenant": tenant}


def test_through_the_internal_api_the_tenant_over_its_share_gets_429_and_another_is_served() -> (
    None
):
    with decode_app(SHARE) as (client, llm):
        assert client.post("/internal/reserve", json=reserve_body("team-a-1", "team-a")).is_success
        over = client.post("/internal/reserve", json=reserve_body("team-a-2", "team-a"))
        assert over.status_code == 429, over.text
        assert over.headers["retry-after"] == "1"
        assert over.json()["error"]["code"] == "tenant_pool_share"
        other = client.post("/internal/reserve", json=reserve_body("team-b-1", "team-b"))
        assert other.is_success, other.text
        # no tenant named: the default tenant's share, not team-a's
        default = client.post("/internal/reserve", json=reserve_body("x-1", None))
        assert default.is_success, default.text
        assert llm.shares.by_tenant() == {t: FOOTPRINT for t in ("team-a", "team-b", "default")}
        for request_id in ("team-a-1", "team-b-1", "x-1"):
            assert client.post("/internal/abort", json={"request_id": request_id}).is_success
        deadline = time.monotonic() + 5
        while llm.shares.by_tenant() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.shares.by_tenant() == {}


def test_a_tenant_name_outside_the_pattern_is_a_400_on_the_internal_api() -> None:
    with decode_app(SHARE) as (client, _):
        r = client.post("/internal/reserve", json=reserve_body("bad-1", "team/x"))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tenant"
