"""How many prefill and decode pods to run, from their load: one pure function of the
autoscaling spec, the current replicas, each role's load and the recent recommendations
(`plan_scaling`), and every change explained.

Per role, as Kubernetes' HPA computes it (its v2 algorithm, which users already know):

- the raw count is proportional: ceil(ready pods x value per pod / target). A per-pod signal
  (queued prompt tokens, running sequences) is the role's total over its ready pods; a
  latency (TTFT, inter-token, p90) or the pool's utilization is the ready pods' own figure.
  Within 10% of the target nothing changes (HPA's tolerance). A role with no ready pod, or
  none that reported its load, keeps its count: there is nothing to scale on, and scaling up
  a role whose pods never become Ready (a pool that no longer fits, a crash loop) would only
  add pods that never serve. Nor does a role scale up while pods it was given are still
  starting: what they will take is not in the signal yet (a pod that never starts holds it);
- the value is the mean of this pass's and those of the last SMOOTH_SECONDS of passes: a queue
  read once a pass swings from empty to full, and the lowest recommendation of a window would
  otherwise be a lull's (bench/autoscale.py's 8-client step waited 43 s for a lull-free
  window before it was smoothed);
- the count is kept within [minReplicas, maxReplicas];
- stabilization: a scale-up acts on the lowest count recommended over its window, a
  scale-down on the highest (so a spike, or a lull, shorter than the window moves nothing);
  and a scale-down waits until the recommendations cover the whole window (after an operator
  restart the history is empty: no scale-down on one pass's figure);
- then the prefill:decode ratio guard: a pair outside [min, max] is brought inside by raising
  the role that is short (never beyond its max), else by lowering the other (never below its
  min); the spec's rules make some pair within bounds exist.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from pydantic import ValidationError

from kvfence_engine.contracts import LoadReport
from kvfence_operator.crd.types import (
    AutoscalingSpec,
    RatioGuard,
    RoleAutoscaling,
    ScalingSignal,
)

TOLERANCE = 0.1  # HPA's: within 10% of the target, no change
SMOOTH_SECONDS = 10.0  # the signal is the mean of the passes' values over this long
# Signals whose value is a total over the role's ready pods (per pod: divided by them)
TOTALS = {ScalingSignal.QUEUED_PROMPT_TOKENS, ScalingSignal.RUNNING_SEQUENCES}
UNITS = {
    ScalingSignal.QUEUED_PROMPT_TOKENS: "prompt tokens queued per pod",
    ScalingSignal.TIME_TO_FIRST_TOKEN: "s p90 time to first token",
    ScalingSignal.KV_POOL_UTILIZATION: "of the KV pool in use",
    ScalingSignal.RUNNING_SEQUENCES: "sequences running or waiting per pod",
    ScalingSignal.INTER_TOKEN_LATENCY: "s p90 between tokens",
}


class Bound(StrEnum):
    """What, beyond the signal, set the count."""

    NONE = ""
    MIN = "minReplicas"
    MAX = "maxReplicas"
    TOLERANCE = "tolerance"
    STABILIZATION = "stabilization"
    NO_SIGNAL = "no signal"
    STARTING = "pods starting"
    RATIO = "prefillToDecodeRatio"


STALE_SECONDS = 10.0  # a load read longer ago than this says nothing of now


@dataclass(frozen=True, slots=True)
class PodLoad:
    """One engine pod's /v1/load as the operator read it: a report, or why there is none."""

    pod: str
    role: str
    revision: str
    report: LoadReport | None = None
    error: str | None = None
    read_at: float = 0.0  # time.time() when the report was read

    def fresh(self, now: float) -> LoadReport | None:
        return self.report if now - self.read_at <= STALE_SECONDS else None

    @property
    def busy(self) -> bool:
        """Anything in flight when it was read (unknown: busy)."""
        r = self.report
        return r is None or r.running_sequences + r.waiting_requests > 0


def parse_load(pod: str, role: str, revision: str, payload: object, read_at: float) -> PodLoad:
    """Garbage, or a report about another role or revision, counts as no report."""
    try:
        report = LoadReport.model_validate(payload)
    except ValidationError as exc:
        why = f"malformed /v1/load ({exc.error_count()} errors)"
        return PodLoad(pod, role, revision, error=why)
    if report.role != role or report.revision != revision:
        return PodLoad(pod, role, revision, error="/v1/load reports another role or revision")
    return PodLoad(pod, role, revision, report, read_at=read_at)


def pod_figure(signal: ScalingSignal, report: LoadReport) -> float | None:
    """One pod's value of `signal`. A latency with no sample in its window is an idle pod's
    0, but a busy pod's unknown (None): it has not finished a first token in a minute."""
    match signal:
        case ScalingSignal.QUEUED_PROMPT_TOKENS:
            return float(report.queued_prompt_tokens)
        case ScalingSignal.RUNNING_SEQUENCES:
            # with those waiting for a slot: running alone stops at --max-num-seqs, and a
            # signal that cannot pass its target never scales up
            return float(report.running_sequences + report.waiting_requests)
        case ScalingSignal.KV_POOL_UTILIZATION:
            return report.pool_utilization
        case ScalingSignal.TIME_TO_FIRST_TOKEN:
            idle = report.waiting_requests == 0 and report.queued_prompt_tokens == 0
            latency = report.time_to_first_token_p90_seconds
        case ScalingSignal.INTER_TOKEN_LATENCY:
            idle = report.running_sequences == 0
            latency = report.inter_token_latency_p90_seconds
    if latency is None:
        return 0.0 if idle else None
    return latency


@dataclass(frozen=True, slots=True)
class RoleLoad:
    """A role's load as its ready pods reported it."""

    ready: int  # pods serving (their pool gate open) with a fresh load report
    value: float | None  # the signal: a total over the ready pods, or their figure; None: none
    starting: int = 0  # pods the role runs that do not serve yet


def role_load(
    signal: ScalingSignal, loads: Sequence[PodLoad], starting: int, now: float
) -> RoleLoad:
    """The role's load from the fresh reports of its serving pods (`loads`): a per-pod
    signal's total, or the mean of the pods' figures."""
    reports = [r for load in loads if (r := load.fresh(now)) is not None]
    figures = [f for r in reports if (f := pod_figure(signal, r)) is not None]
    if not figures:
        return RoleLoad(0, None, starting)
    total = sum(figures)
    value = total if signal in TOTALS else total / len(figures)
    return RoleLoad(len(figures), value, starting)


@dataclass(frozen=True, slots=True)
class Recommendation:
    at: float  # time.time() of the pass
    replicas: int
    value: float | None = None  # the signal's value per pod that pass, before smoothing


@dataclass(frozen=True, slots=True)
class RoleDecision:
    role: str
    current: int
    desired: int
    recommended: int  # before stabilization and the ratio guard
    signal: ScalingSignal
    value: float | None  # per pod, or the role's figure
    target: float
    bound: Bound = Bound.NONE
    raw: float | None = None  # this pass's value per pod, before smoothing

    @property
    def changes(self) -> bool:
        return self.desired != self.current

    def reason(self) -> str:
        """The Event's message: the signal, its value, the target and the bound that applied."""
        unit = UNITS[self.signal]
        said = "no load reported" if self.value is None else f"{self.value:.3g} {unit}"
        bound = f"; {self.bound} applied" if self.bound is not Bound.NONE else ""
        return (
            f"{self.role}: {self.current} -> {self.desired} replicas: {self.signal} {said}, "
            f"target {self.target:g}{bound}"
        )


def per_pod(scaling: RoleAutoscaling, load: RoleLoad) -> float | None:
    """The signal's value per pod (a total over the ready pods, divided by them), this pass."""
    if load.ready == 0 or load.value is None:
        return None
    return load.value / load.ready if scaling.signal in TOTALS else load.value


def smoothed(value: float | None, history: Sequence[Recommendation], now: float) -> float | None:
    """The mean of this pass's value and those of the passes in the last SMOOTH_SECONDS: a
    queue read once a pass swings from empty to full between passes, and stabilization, which
    acts on the lowest recommendation of its window, would otherwise wait for a window with
    no lull in it."""
    if value is None:
        return None
    recent = [r.value for r in history if r.value is not None and now - r.at <= SMOOTH_SECONDS]
    return (value + sum(recent)) / (1 + len(recent))


def recommend(
    scaling: RoleAutoscaling, current: int, load: RoleLoad, value: float | None
) -> tuple[int, Bound]:
    """The role's count from its signal's value per pod alone, within its bounds."""
    if value is None:
        return current, Bound.NO_SIGNAL
    ratio = value / scaling.target
    if abs(ratio - 1.0) <= TOLERANCE:
        raw, bound = current, Bound.TOLERANCE
    else:
        raw, bound = math.ceil(load.ready * ratio - 1e-9), Bound.NONE
    if raw < scaling.min_replicas:
        return scaling.min_replicas, Bound.MIN
    if raw > scaling.max_replicas:
        return scaling.max_replicas, Bound.MAX
    return raw, bound


def stabilized(
    scaling: RoleAutoscaling,
    current: int,
    recommended: int,
    history: Sequence[Recommendation],
    now: float,
) -> int:
    """HPA's stabilization over this pass's recommendation and the recent ones."""
    if recommended > current:
        window = [
            r.replicas for r in history if now - r.at <= scaling.scale_up_stabilization_seconds
        ]
        return max(current, min([recommended, *window]))
    if recommended < current:
        span = scaling.scale_down_stabilization_seconds
        if not history or now - min(r.at for r in history) < span:
            return current  # the window is not covered yet
        window = [r.replicas for r in history if now - r.at <= span]
        return min(current, max([recommended, *window]))
    return current


def decide_role(
    role: str,
    scaling: RoleAutoscaling,
    current: int,
    load: RoleLoad,
    history: Sequence[Recommendation],
    now: float,
) -> RoleDecision:
    raw = per_pod(scaling, load)
    value = smoothed(raw, history, now)
    recommended, bound = recommend(scaling, current, load, value)
    desired = stabilized(scaling, current, recommended, history, now)
    if desired != recommended and bound in (Bound.NONE, Bound.MIN, Bound.MAX):
        bound = Bound.STABILIZATION
    if desired > current and load.starting > 0:
        desired, bound = current, Bound.STARTING
    # a count outside the bounds (the spec's bounds changed) is brought inside at once
    desired = min(max(desired, scaling.min_replicas), scaling.max_replicas)
    return RoleDecision(
        role, current, desired, recommended, scaling.signal, value, scaling.target, bound, raw
    )


def guard_ratio(
    prefill: RoleDecision,
    decode: RoleDecision,
    guard: RatioGuard,
    bounds: tuple[RoleAutoscaling, RoleAutoscaling],
) -> tuple[RoleDecision, RoleDecision]:
    """The pair brought within guard.min <= prefill / decode <= guard.max: the short role is
    raised (up to its max), else the other lowered (down to its min)."""
    p_bounds, d_bounds = bounds
    p, d = prefill.desired, decode.desired
    if p > guard.max * d:  # too few decode pods
        d = min(d_bounds.max_replicas, math.ceil(p / guard.max - 1e-9))
        if p > guard.max * d:
            p = max(p_bounds.min_replicas, math.floor(guard.max * d + 1e-9))
    elif p < guard.min * d:  # too few prefill pods
        p = min(p_bounds.max_replicas, math.ceil(guard.min * d - 1e-9))
        if p < guard.min * d:
            d = max(d_bounds.min_replicas, math.floor(p / guard.min + 1e-9))
    if p != prefill.desired:
        prefill = replace(prefill, desired=p, bound=Bound.RATIO)
    if d != decode.desired:
        decode = replace(decode, desired=d, bound=Bound.RATIO)
    return prefill, decode


@dataclass(frozen=True, slots=True)
class ScalingPlan:
    decisions: dict[str, RoleDecision]  # by role; a role without autoscaling is absent

    def desired(self, role: str, otherwise: int) -> int:
        decision = self.decisions.get(role)
        return otherwise if decision is None else decision.desired


def plan_scaling(
    spec: AutoscalingSpec,
    current: dict[str, int],
    loads: dict[str, RoleLoad],
    history: Mapping[str, Sequence[Recommendation]],
    now: float,
) -> ScalingPlan:
    """Each scaled role's count this pass (Operator mode; External decides nothing here)."""
    decisions = {}
    for role, scaling in (("prefill", spec.prefill), ("decode", spec.decode)):
        if scaling is not None:
            decisions[role] = decide_role(
                role, scaling, current[role], loads[role], history.get(role, ()), now
            )
    guard = spec.prefill_to_decode_ratio
    if guard is not None and spec.prefill is not None and spec.decode is not None:
        decisions["prefill"], decisions["decode"] = guard_ratio(
            decisions["prefill"], decisions["decode"], guard, (spec.prefill, spec.decode)
        )
    return ScalingPlan(decisions)
