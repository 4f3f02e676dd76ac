"""An engine's load report (GET /v1/load, contracts.LoadReport): the signals an autoscaler
scales on, read off the engine without a Prometheus (and the same figures as metrics)."""

from helpers.engines import make_tiny_engine, prompt_of
from kvfence_engine.core.engine import Load
from kvfence_engine.core.recent import RecentQuantile
from kvfence_engine.core.request import SamplingParams


def test_a_recent_quantile_forgets_what_left_its_window_and_keeps_its_capacity() -> None:
    now = [0.0]
    recent = RecentQuantile(window=60.0, capacity=100, clock=lambda: now[0])
    assert recent.quantile(0.9) is None
    for i in range(1, 11):
        recent.observe(float(i))
    assert recent.quantile(0.9) == 9.0 and recent.quantile(0.5) == 5.0  # nearest rank
    now[0] = 61.0  # all ten are older than the window
    recent.observe(100.0)
    assert recent.quantile(0.9) == 100.0
    for i in range(500):
        recent.observe(float(i))
    assert recent.quantile(0.0) == 400.0  # the newest 100 kept


def test_the_load_report_counts_the_queue_then_the_running_then_nothing() -> None:
    engine = make_tiny_engine(pages=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    seqs = [engine.admit(prompt_of(40, seed=i), params, max_tokens=4) for i in range(3)]
    for seq in seqs:
        engine.add(seq)
    engine._take_load()  # what the engine thread does after each step
    report = engine.load_report()
    assert (report.waiting_requests, report.queued_prompt_tokens) == (3, 120)
    assert report.running_sequences == 0 and report.time_to_first_token_p90_seconds is None
    engine.step()  # the three prefills
    engine.step()  # a decode step; the figures are taken every LOAD_EVERY while busy:
    engine._load = Load(0.0, 0, 0, 0)  # as if that much time had passed
    engine._take_load()
    busy = engine.load_report()
    assert busy.waiting_requests == 0 and busy.running_sequences == 3
    assert busy.pages_used == 3 * 3 and busy.pool_utilization == 9 / busy.pages_total
    while engine.has_work():
        engine.step()
    idle = engine.load_report()
    assert (idle.waiting_requests, idle.running_sequences, idle.pages_used) == (0, 0, 0)
    ttft, itl = idle.time_to_first_token_p90_seconds, idle.inter_token_latency_p90_seconds
    assert ttft is not None and itl is not None and itl > 0
    text = engine.metrics.registry.get_sample_value("kvfence_inter_token_latency_seconds_count")
    assert text == 3 * 3  # three tokens after each first one
