"""What a pass does about the engine roles' replica counts: the spec's counts, or the
autoscaler's (spec.autoscaling), applied without a rollout. Pure; decide.py calls it.

- No autoscaling: every revision's Deployments run the spec's counts.
- Operator: each scaled role's count is decided on the serving revision's load alone
  (autoscaling.plan_scaling), from the count decided last (status.autoscaling, which survives
  an operator restart; the first time, the spec's count within the bounds). The serving
  revision scales up at once and down through a drain (draining.py); a candidate runs the
  decided count (so a promotion hands the load to as many pods), without a drain, since it
  serves no one. Until a revision serves, the count stays where it is: there is no load.
- External: a user's HPA or KEDA owns the child Deployments' replicas: a Deployment is created
  with the spec's count and its replicas are never declared again (drift leaves them).
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvfence_operator.crd.types import (
    AutoscalingMode,
    AutoscalingSpec,
    AutoscalingStatus,
    EventReason,
    InferenceDeploymentSpec,
    Role,
    RoleAutoscaling,
    RoleScalingStatus,
    ScalingSignal,
)
from kvfence_operator.decisions.autoscaling import (
    Recommendation,
    RoleDecision,
    plan_scaling,
    role_load,
)
from kvfence_operator.decisions.draining import DrainPlan, RolePod, plan_drain
from kvfence_operator.decisions.rollout import Event

ROLES = (Role.PREFILL, Role.DECODE)


@dataclass(frozen=True, slots=True)
class ServingRole:
    """One role of the serving revision as the pass saw it."""

    replicas: int | None  # its Deployment's spec.replicas; None: no Deployment
    pods: tuple[RolePod, ...]


@dataclass(frozen=True, slots=True)
class Counts:
    """Replicas to declare per engine role; None: not declared (External)."""

    prefill: int | None
    decode: int | None

    def of(self, role: Role) -> int | None:
        return self.prefill if role is Role.PREFILL else self.decode


@dataclass(frozen=True, slots=True)
class ScalingOutcome:
    serving: Counts  # the serving revision's Deployments
    candidate: Counts  # any other revision declared this pass
    drains: Mapping[Role, DrainPlan] = field(default_factory=dict)
    draining: frozenset[str] = frozenset()  # pods out of the routers' backends
    recommendations: Mapping[Role, Recommendation] = field(default_factory=dict)
    status: AutoscalingStatus | None = None
    events: tuple[Event, ...] = ()
    floors: Mapping[str, int] = field(default_factory=dict)  # the least a scaled role serves


def starting_counts(spec: InferenceDeploymentSpec) -> Counts:
    """What a deployment starts each engine role at: its replicas, within its autoscaling
    bounds (Operator mode). `kvfence up` runs these and scales no further."""
    fixed = Counts(spec.prefill.replicas, spec.decode.replicas)
    scaling = spec.autoscaling
    if scaling is None or scaling.mode is not AutoscalingMode.OPERATOR:
        return fixed
    return _counts(
        fixed,
        {
            role: _decided(role, bounds, None, fixed)
            for role in ROLES
            if (bounds := _bounds(scaling, role)) is not None
        },
    )


def plan_pass_scaling(
    spec: InferenceDeploymentSpec,
    previous: AutoscalingStatus | None,
    serving: Mapping[Role, ServingRole] | None,
    history: Mapping[Role, Sequence[Recommendation]],
    now: float,
) -> ScalingOutcome:
    """`serving`: the serving revision's roles (None: no revision serves yet); `now`:
    time.time()."""
    fixed = Counts(spec.prefill.replicas, spec.decode.replicas)
    scaling = spec.autoscaling
    if scaling is None:
        return ScalingOutcome(fixed, fixed)
    if scaling.mode is AutoscalingMode.EXTERNAL:
        status = AutoscalingStatus(
            mode=scaling.mode,
            **{
                str(role): RoleScalingStatus(current=s.replicas or 0)
                for role, s in (serving or {}).items()
            },
        )
        return ScalingOutcome(Counts(None, None), Counts(None, None), status=status)
    decided = {
        role: _decided(role, bounds, previous, fixed)
        for role in ROLES
        if (bounds := _bounds(scaling, role)) is not None
    }
    floors = {str(role): min(count, _min(scaling, role)) for role, count in decided.items()}
    if serving is None:
        counts = _counts(fixed, decided)
        status = _status(scaling, previous, decided, {}, {}, {}, now)
        return ScalingOutcome(counts, counts, status=status, floors=floors)

    loads = {}
    for role in decided:
        kept = [p for p in serving[role].pods if p.draining_since is None]
        ready = [p.load for p in kept if p.serving and p.load is not None]
        starting = sum(1 for p in kept if not p.serving)
        loads[str(role)] = role_load(_signal(scaling, role), ready, starting, now)
    history_by_name = {str(role): recs for role, recs in history.items()}
    plan = plan_scaling(
        scaling, {str(r): c for r, c in decided.items()}, loads, history_by_name, now
    )
    decisions = {Role(name): d for name, d in plan.decisions.items()}
    desired = {role: d.desired for role, d in decisions.items()}
    drains = {
        role: plan_drain(
            count if (live := serving[role].replicas) is None else live,
            count,
            serving[role].pods,
            now,
            spec.rollout.termination_grace_period_seconds,
        )
        for role, count in desired.items()
    }
    draining = frozenset(
        name for role, drain in drains.items() for name in drain.draining(serving[role].pods)
    )
    events = [
        *(_edited(role, serving[role], previous, drains[role].replicas) for role in drains),
        *(_scaled(d) for d in decisions.values() if d.changes),
        *(_draining(role, drain, desired[role]) for role, drain in drains.items() if drain.mark),
    ]
    running = {role: drain.replicas for role, drain in drains.items()}
    return ScalingOutcome(
        _counts(fixed, running),
        _counts(fixed, desired),
        drains,
        draining,
        {role: Recommendation(now, d.recommended, d.raw) for role, d in decisions.items()},
        _status(scaling, previous, desired, decisions, drains, serving, now),
        tuple(e for e in events if e is not None),
        floors,
    )


def _bounds(scaling: AutoscalingSpec, role: Role) -> RoleAutoscaling | None:
    return scaling.prefill if role is Role.PREFILL else scaling.decode


def _min(scaling: AutoscalingSpec, role: Role) -> int:
    bounds = _bounds(scaling, role)
    assert bounds is not None
    return bounds.min_replicas


def _signal(scaling: AutoscalingSpec, role: Role) -> ScalingSignal:
    bounds = _bounds(scaling, role)
    assert bounds is not None
    return bounds.signal


def _decided(
    role: Role, bounds: RoleAutoscaling, previous: AutoscalingStatus | None, fixed: Counts
) -> int:
    """The count decided last (status), else the spec's; within the bounds."""
    last = getattr(previous, str(role), None) if previous is not None else None
    count = last.desired if last is not None and last.desired is not None else None
    if count is None or previous is None or previous.mode is not AutoscalingMode.OPERATOR:
        count = fixed.of(role) or 0
    return min(max(count, bounds.min_replicas), bounds.max_replicas)


def _counts(fixed: Counts, decided: Mapping[Role, int]) -> Counts:
    return Counts(decided.get(Role.PREFILL, fixed.prefill), decided.get(Role.DECODE, fixed.decode))


def _status(
    scaling: AutoscalingSpec,
    previous: AutoscalingStatus | None,
    desired: Mapping[Role, int],
    decisions: Mapping[Role, RoleDecision],
    drains: Mapping[Role, DrainPlan],
    serving: Mapping[Role, ServingRole],
    now: float,
) -> AutoscalingStatus:
    roles = {}
    for role, count in desired.items():
        last = getattr(previous, str(role), None) if previous is not None else None
        decision = decisions.get(role)
        bounds = _bounds(scaling, role)
        assert bounds is not None
        changed = decision is not None and decision.changes
        at = datetime.fromtimestamp(now, UTC).replace(microsecond=0) if changed else None
        drain = drains.get(role)
        roles[str(role)] = RoleScalingStatus(
            current=drain.replicas if drain is not None else count,
            desired=count,
            signal=bounds.signal,
            value=_rounded(decision.value) if decision is not None else None,
            target=bounds.target,
            bound=(decision.bound or None) if decision is not None else None,
            draining=sorted(drain.waiting_for) or None if drain is not None else None,
            last_scale_time=at or (last.last_scale_time if last is not None else None),
        )
    return AutoscalingStatus(mode=scaling.mode, **roles)


def _rounded(value: float | None) -> float | None:
    """Three significant digits: a status that changes only with the load's shape."""
    if value is None or value == 0:
        return value
    digits = 2 - math.floor(math.log10(abs(value)))
    return round(value, digits)


def _edited(
    role: Role, seen: ServingRole, previous: AutoscalingStatus | None, declared: int
) -> Event | None:
    """A Warning when the serving Deployment's replicas are neither what the last pass left
    them at (status.autoscaling: someone else changed them) nor what this pass declares: it
    puts them back."""
    last = getattr(previous, str(role), None) if previous is not None else None
    if seen.replicas is None or last is None or seen.replicas in (last.current, declared):
        return None
    return Event(
        "Warning",
        EventReason.REPLICAS_REPAIRED,
        f"{role}: its Deployment was set to {seen.replicas} replicas by someone else: put back "
        f"to {declared}, the autoscaler's count (spec.autoscaling; mode External leaves "
        "replicas to your own autoscaler)",
    )


def _scaled(decision: RoleDecision) -> Event:
    return Event("Normal", EventReason.SCALED, decision.reason())


def _draining(role: Role, drain: DrainPlan, desired: int) -> Event:
    pods = ", ".join(drain.mark)
    return Event(
        "Normal",
        EventReason.DRAINING,
        f"{role}: {pods} left the routers' backends for the scale-down to {desired} replicas; "
        "removed once their streams finish",
    )
