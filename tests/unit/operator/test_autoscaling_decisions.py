"""The autoscaling decision (decisions/autoscaling.py) on traces: a ramp, a spike, a plateau,
flapping load, pods that never become Ready, a pool that no longer fits; and the anchors'
failure cases: never past max, scaling down when the load goes, the ratio guard kept.

A trace is a pass every 10 s: each role's load comes from a function of time and of the pods
that serve (a new pod serves `ready_after` seconds after it was asked for; a count lowered
takes effect at once), the decision's desired count becomes the next pass's current one, and
every recommendation is kept as the operator keeps it."""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvfence_engine.contracts import LoadReport
from kvfence_operator.crd.types import (
    AutoscalingSpec,
    InferenceDeploymentSpec,
    Role,
    RoleAutoscaling,
    ScalingSignal,
)
from kvfence_operator.decisions.autoscaling import (
    Bound,
    PodLoad,
    Recommendation,
    RoleLoad,
    plan_scaling,
    role_load,
)
from kvfence_operator.decisions.draining import DrainPlan, RolePod, plan_drain
from kvfence_operator.decisions.scaling import Counts, starting_counts
from kvfence_operator.reconcile.history import ScalingHistory

STEP = 10.0


def scaling(signal: str, target: float, lo: int = 1, hi: int = 8, **windows: int) -> dict:
    return {"minReplicas": lo, "maxReplicas": hi, "signal": signal, "target": target, **windows}


def spec(**roles: object) -> AutoscalingSpec:
    return AutoscalingSpec.model_validate(roles)


# demand in "pods' worth" at time t -> the role's signal total (running sequences, 6 a pod)
Demand = Callable[[float], float]


@dataclass
class Trace:
    spec: AutoscalingSpec
    demand: dict[str, Demand]
    start: dict[str, int] = field(default_factory=lambda: {"decode": 1})
    ready_after: float = 20.0
    never_ready: set[str] = field(default_factory=set)
    serve_at_most: int = 1000  # pods past this many never become Ready
    counts: dict[str, list[int]] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    def run(self, seconds: float) -> "Trace":
        current = dict(self.start)
        asked: dict[str, list[tuple[float, int]]] = {r: [(-1e9, c)] for r, c in current.items()}
        history: dict[str, list[Recommendation]] = {r: [] for r in current}
        self.counts = {r: [] for r in current}
        t = 0.0
        while t <= seconds:
            loads = {}
            for role in current:
                # pods asked for at least ready_after ago serve (a lowered count at once)
                served = [n for at, n in asked[role] if t - at >= self.ready_after]
                ready = 0 if role in self.never_ready else min(current[role], served[-1])
                ready = min(ready, self.serve_at_most)
                starting = current[role] - ready  # asked for, not serving yet
                loads[role] = RoleLoad(ready, self.signal(role, t, ready), starting)
            plan = plan_scaling(self.spec, current, loads, history, t)
            for role, decision in plan.decisions.items():
                history[role].append(Recommendation(t, decision.recommended))
                if decision.changes:
                    self.reasons.append(f"t={t:.0f} {decision.reason()}")
                    asked[role].append((t, decision.desired))
                current[role] = decision.desired
            for role in current:
                self.counts[role].append(current[role])
            t += STEP
        return self

    def signal(self, role: str, t: float, ready: int) -> float | None:
        if ready == 0:
            return None
        role_spec = getattr(self.spec, role)
        need = self.demand[role](t)
        if role_spec.signal in ("RunningSequences", "QueuedPromptTokens"):
            return need * role_spec.target  # a total: need pods' worth at the target
        return need / ready * role_spec.target  # a per-pod figure: the target times overload


def decode_only(demand: Demand, **windows: int) -> Trace:
    return Trace(spec(decode=scaling("RunningSequences", 6, **windows)), {"decode": demand})


def test_a_ramp_scales_up_step_by_step_and_back_down_after_the_window() -> None:
    """Demand 1 -> 6 pods over 5 minutes, then back to 1: up within the up window of each
    step, never past max, and down only once the lull covered the 300 s down window."""
    ramp = lambda t: 1 + 5 * min(t, 300) / 300 if t < 600 else 1.0  # noqa: E731
    trace = decode_only(ramp).run(1200)
    counts = trace.counts["decode"]
    assert max(counts) == 6 and counts[31] == 6  # at t = 310 s
    assert counts == sorted(counts[:60]) + counts[60:]  # no step down while it ramps
    assert counts[int(600 / STEP) + 29] == 6  # 290 s into the lull: still held
    assert counts[-1] == 1  # and down once the window is covered
    assert all("RunningSequences" in r and "target 6" in r for r in trace.reasons)


def test_a_spike_shorter_than_the_scale_up_window_scales_nothing() -> None:
    """A 10 s burst to 5 pods' worth, with a 30 s up window: the lowest recommendation over
    the window is the quiet one."""
    spike = lambda t: 5.0 if 100 <= t < 110 else 1.0  # noqa: E731
    trace = decode_only(spike, scaleUpStabilizationSeconds=30).run(300)
    assert set(trace.counts["decode"]) == {1}


def test_a_plateau_at_the_target_holds_within_the_tolerance() -> None:
    trace = decode_only(lambda t: 3.0 if t < 60 else 3.25).run(900)  # 3.25 pods: 8% over 3
    counts = trace.counts["decode"]
    assert counts[10:] == [3] * len(counts[10:])


def test_flapping_load_scales_up_once_and_never_down_within_the_window() -> None:
    """Demand swinging between 2 and 4 pods' worth every 40 s: up to 4 and held there."""
    flap = lambda t: 4.0 if int(t // 40) % 2 else 2.0  # noqa: E731
    trace = decode_only(flap).run(1200)
    counts = trace.counts["decode"]
    changes = [b for a, b in itertools.pairwise(counts) if a != b]
    assert max(counts) == 4 and counts[-1] == 4
    assert all(b > a for a, b in itertools.pairwise(counts) if a != b), changes


def test_pods_that_never_become_ready_are_not_scaled_past() -> None:
    """A role none of whose pods ever serves (a pool that no longer fits, a crash loop)
    reports nothing: its count is kept, not grown for load it cannot see."""
    trace = decode_only(lambda t: 20.0)
    trace.never_ready = {"decode"}
    trace.start = {"decode": 2}
    trace.run(600)
    assert set(trace.counts["decode"]) == {2}
    assert not trace.reasons


def test_a_scale_up_whose_new_pods_never_become_ready_is_not_scaled_past() -> None:
    """Two pods serve at 2.5x load; the pods added for it never become Ready: the role is not
    grown again while they are starting (one change, no more)."""
    trace = decode_only(lambda t: 5.0)
    trace.start = {"decode": 2}
    trace.serve_at_most = 2
    trace.run(600)
    counts = trace.counts["decode"]
    grown = counts[-1]
    assert 2 < grown < 8 and counts[-20:] == [grown] * 20
    assert len(trace.reasons) == 1


def test_a_pool_that_no_longer_fits_holds_the_count_it_had() -> None:
    """Three pods serving at 2x load scale up to 6; then every gate closes (the pool no longer
    fits): the count stays at what it was, neither grown nor dropped."""
    trace = decode_only(lambda t: 6.0)
    trace.start = {"decode": 3}
    trace.run(120)
    assert trace.counts["decode"][-1] == 6
    stuck = decode_only(lambda t: 6.0)
    stuck.start = {"decode": 6}
    stuck.never_ready = {"decode"}
    stuck.run(600)
    assert set(stuck.counts["decode"]) == {6}


def test_a_load_far_past_max_never_asks_for_more_than_max() -> None:
    trace = decode_only(lambda t: 1000.0).run(600)
    assert max(trace.counts["decode"]) == 8
    assert "maxReplicas applied" in trace.reasons[-1]


def test_scaling_down_when_the_load_goes_reaches_min() -> None:
    trace = decode_only(lambda t: 8.0 if t < 120 else 0.0)
    trace.start = {"decode": 8}
    trace.run(900)
    assert trace.counts["decode"][-1] == 1
    assert "minReplicas applied" in trace.reasons[-1]


def test_an_operator_restart_scales_nothing_down_before_the_window_is_covered() -> None:
    """No history (a new leader): the first pass's low figure is not acted on."""
    s = spec(decode=scaling("RunningSequences", 6))
    plan = plan_scaling(s, {"decode": 5}, {"decode": RoleLoad(5, 6.0)}, {}, now=1000.0)
    assert plan.decisions["decode"].desired == 5
    assert plan.decisions["decode"].bound is Bound.STABILIZATION


def test_latency_signals_scale_in_proportion_to_how_far_past_the_target() -> None:
    """TTFT p90 of 2 s against a 0.5 s target on 2 pods: 8 pods asked for (HPA's ratio)."""
    s = spec(prefill=scaling("TimeToFirstToken", 0.5, hi=16, scaleUpStabilizationSeconds=0))
    plan = plan_scaling(s, {"prefill": 2}, {"prefill": RoleLoad(2, 2.0)}, {}, now=0.0)
    decision = plan.decisions["prefill"]
    assert decision.desired == 8
    assert decision.reason() == (
        "prefill: 2 -> 8 replicas: TimeToFirstToken 2 s p90 time to first token, target 0.5"
    )


RATIO = {"min": 0.5, "max": 1.0}


@settings(max_examples=200, deadline=None)
@given(
    p_load=st.floats(0, 50),
    d_load=st.floats(0, 50),
    p_now=st.integers(1, 6),
    d_now=st.integers(1, 8),
)
def test_the_ratio_guard_holds_whatever_the_loads(
    p_load: float, d_load: float, p_now: int, d_now: int
) -> None:
    s = spec(
        prefill=scaling("QueuedPromptTokens", 1000, hi=6, scaleUpStabilizationSeconds=0),
        decode=scaling("RunningSequences", 6, hi=8, scaleUpStabilizationSeconds=0),
        prefillToDecodeRatio=RATIO,
    )
    loads = {"prefill": RoleLoad(p_now, p_load * 1000), "decode": RoleLoad(d_now, d_load * 6)}
    history = {r: [Recommendation(0.0, 1)] for r in ("prefill", "decode")}  # a covered window
    plan = plan_scaling(s, {"prefill": p_now, "decode": d_now}, loads, history, now=1000.0)
    p, d = plan.desired("prefill", p_now), plan.desired("decode", d_now)
    assert 1 <= p <= 6 and 1 <= d <= 8
    assert RATIO["min"] <= p / d <= RATIO["max"], (p, d, plan)


def test_the_ratio_guard_raises_the_short_role_and_says_so() -> None:
    s = spec(
        prefill=scaling("QueuedPromptTokens", 1000, hi=6, scaleUpStabilizationSeconds=0),
        decode=scaling("RunningSequences", 6, hi=8, scaleUpStabilizationSeconds=0),
        prefillToDecodeRatio=RATIO,
    )
    loads = {"prefill": RoleLoad(1, 4000.0), "decode": RoleLoad(1, 6.0)}
    plan = plan_scaling(s, {"prefill": 1, "decode": 1}, loads, {}, now=0.0)
    assert plan.decisions["prefill"].desired == 4
    assert plan.decisions["decode"].desired == 4  # raised to keep prefill / decode <= 1
    assert "prefillToDecodeRatio applied" in plan.decisions["decode"].reason()


@pytest.mark.parametrize(
    ("roles", "message"),
    [
        ({"decode": scaling("RunningSequences", 6, lo=4, hi=2)}, "minReplicas must be <= max"),
        ({"decode": scaling("TimeToFirstToken", 1.0)}, "decode scales on"),
        ({"prefill": scaling("KvPoolUtilization", 0.8)}, "prefill scales on"),
        ({"decode": scaling("KvPoolUtilization", 80)}, "at most 1"),
        ({"decode": scaling("RunningSequences", 6), "prefillToDecodeRatio": RATIO}, "needs both"),
        (
            {
                "prefill": scaling("QueuedPromptTokens", 1000, lo=1, hi=2),
                "decode": scaling("RunningSequences", 6, lo=6, hi=8),
                "prefillToDecodeRatio": RATIO,  # prefill 2 / decode 6 < 0.5 at best
            },
            "admits no replica counts",
        ),
    ],
)
def test_an_inconsistent_autoscaling_block_is_refused_by_name(roles: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(**roles)


def test_role_autoscaling_defaults() -> None:
    r = RoleAutoscaling.model_validate(scaling("RunningSequences", 6))
    assert (r.scale_up_stabilization_seconds, r.scale_down_stabilization_seconds) == (30, 300)
    assert math.isclose(r.target, 6)


# ---- the drain (decisions/draining.py) and the role's load from its pods' reports ----------


def _load(name: str, busy: int = 0, read_at: float = 100.0) -> PodLoad:
    report = LoadReport(
        role="decode", revision="r", waiting_requests=0, queued_prompt_tokens=0,
        running_sequences=busy, pages_used=busy, pages_total=10,
        time_to_first_token_p90_seconds=None, inter_token_latency_p90_seconds=None,
        window_seconds=60,
    )  # fmt: skip
    return PodLoad(name, "decode", "r", report, read_at=read_at)


def _pod(name: str, serving: bool = True, since: float | None = None, busy: int = 0,
         read_at: float = 100.0) -> RolePod:  # fmt: skip
    return RolePod(name, serving, since, _load(name, busy, read_at), 0.0)


def test_a_scale_down_counts_pods_that_do_not_serve_first_and_drains_only_the_rest() -> None:
    pods = [_pod("a", busy=2), _pod("b", busy=0), _pod("c", serving=False)]
    plan = plan_drain(3, 2, pods, now=100.0, grace_seconds=300)
    assert plan == DrainPlan(2)  # c is not Ready: the ReplicaSet removes it, nothing drains
    plan = plan_drain(3, 1, pods, now=100.0, grace_seconds=300)
    assert (plan.replicas, plan.mark) == (3, ("b",))  # the idle one, not the busy one


def test_a_draining_pod_finishes_when_idle_after_the_mark_or_after_the_grace() -> None:
    marked = _pod("a", since=100.0, busy=1, read_at=103.0)
    assert plan_drain(2, 1, [marked, _pod("b")], now=104.0, grace_seconds=300).replicas == 2
    idle_before_mark = _pod("a", since=100.0, busy=0, read_at=100.5)  # the routers may not know
    assert (
        plan_drain(2, 1, [idle_before_mark, _pod("b")], now=101.0, grace_seconds=300).replicas == 2
    )
    idle = _pod("a", since=100.0, busy=0, read_at=103.0)
    assert plan_drain(2, 1, [idle, _pod("b")], now=104.0, grace_seconds=300).replicas == 1
    assert plan_drain(2, 1, [marked, _pod("b")], now=400.0, grace_seconds=300).replicas == 1


def test_the_roles_load_is_its_fresh_reports_total_or_mean_and_an_idle_latency_is_zero() -> None:
    fresh = [_load(n, busy=b) for n, b in (("a", 3), ("b", 5))]
    assert role_load(ScalingSignal.RUNNING_SEQUENCES, fresh, 0, now=101.0) == RoleLoad(2, 8.0)
    assert role_load(ScalingSignal.KV_POOL_UTILIZATION, fresh, 1, 101.0) == RoleLoad(2, 0.4, 1)
    # a stale report says nothing of now; an idle pod's latency with no sample is 0, a busy
    # one's unknown
    assert role_load(ScalingSignal.RUNNING_SEQUENCES, fresh, 0, now=200.0) == RoleLoad(0, None)
    assert role_load(ScalingSignal.INTER_TOKEN_LATENCY, fresh, 0, 101.0) == RoleLoad(0, None)
    idle = [_load("c")]
    assert role_load(ScalingSignal.INTER_TOKEN_LATENCY, idle, 0, 101.0) == RoleLoad(1, 0.0)


def test_a_deployment_starts_each_scaled_role_at_its_replicas_within_the_bounds() -> None:
    """What the operator starts from before it has decided anything, and what `kvfence up`
    runs: the role's replicas brought within minReplicas..maxReplicas; External, and a role
    not scaled, at their replicas."""
    base = {"model": {"source": "builtin:tiny-random"}, "contextLength": 64,
            "router": {"apiKeysSecret": "k"}, "prefill": {"replicas": 0},
            "decode": {"replicas": 9}}  # fmt: skip
    scaled = {"decode": scaling("RunningSequences", 4, lo=2, hi=4)}
    spec_of = InferenceDeploymentSpec.model_validate
    assert starting_counts(spec_of({**base, "autoscaling": scaled})) == Counts(0, 4)
    scaled["prefill"] = scaling("QueuedPromptTokens", 256, lo=1, hi=2)
    assert starting_counts(spec_of({**base, "autoscaling": scaled})) == Counts(1, 4)
    external = {**base, "autoscaling": {"mode": "External"}}
    assert starting_counts(spec_of(external)) == Counts(0, 9)


def test_the_history_keeps_an_hour_and_forgets_an_object_no_pass_scales_any_more() -> None:
    history = ScalingHistory()
    history.record("gone", {Role.DECODE: Recommendation(0.0, 3)})
    history.record("live", {Role.DECODE: Recommendation(10.0, 2)})
    assert history.of("gone") == {Role.DECODE: (Recommendation(0.0, 3),)}
    history.record("live", {Role.DECODE: Recommendation(3601.0, 1)})
    assert history.of("gone") == {}
    assert history.of("live") == {Role.DECODE: (Recommendation(10.0, 2), Recommendation(3601.0, 1))}
    history.record("live", {})  # a pass of an object that scales nothing: nothing changes
    assert len(history.of("live")[Role.DECODE]) == 2


def test_a_queue_swinging_between_passes_is_smoothed_so_a_lull_does_not_hold_a_scale_up() -> None:
    """Two decode pods at twice the target on average, but read once a pass the queue swings
    between empty and four times the target (bench/autoscale.py saw 0 to 4 per pod at 8
    clients). Unsmoothed, a 15 s window always holds a lull's recommendation and nothing
    scales; the mean over the last 10 s scales up once the window is past."""
    s = spec(decode=scaling("RunningSequences", 2, hi=8, scaleUpStabilizationSeconds=15))
    history: list[Recommendation] = []
    counts = []
    for step in range(20):  # a pass every 2 s
        now = 2.0 * step
        total = 16.0 if step % 2 else 0.0  # 8 per pod, then none
        plan = plan_scaling(
            s, {"decode": 2}, {"decode": RoleLoad(2, total)}, {"decode": history}, now
        )
        decision = plan.decisions["decode"]
        history.append(Recommendation(now, decision.recommended, decision.raw))
        counts.append(decision.desired)
    assert counts[:7] == [2] * 7  # within the first window
    assert counts[-1] == 4  # the mean, 4 per pod against 2
    assert decision.value == pytest.approx(4.0, abs=0.7)
