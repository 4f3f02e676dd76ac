"""The InferenceDeployment's status and conditions, decided in one place: from a rollout plan,
what was observed and what the pass met (findings), and for the passes that stop early (an
invalid spec, credentials the operator may not read).

Pure: the same inputs give the same status. Conditions are metav1.Conditions written whole as
a merge patch (which replaces lists), keep their lastTransitionTime unless their status flips,
and carry a reason from crd.types.ConditionReason. Stalled is True only when progress stopped:
a terminal verdict (TERMINAL) or no progress for spec.rollout.progressDeadlineSeconds; a pod
that restarts once is progress, not a stall. Ready is a Deployment's "Available": True while
the serving revision serves with at least its minimum available, during a rollout or a
scale-up too (Progressing says those). An unchanged status is not written.
"""

import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from kvfence_operator.crd.types import (
    AutoscalingStatus,
    CanaryResult,
    CanaryStatus,
    CandidateStatus,
    Condition,
    ConditionReason,
    ConditionStatus,
    ConditionType,
    ContextLengthStatus,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    PoolReport,
    ProgressStatus,
    Role,
)
from kvfence_operator.decisions.canary import JobPhase
from kvfence_operator.decisions.findings import Conflict, Findings, Problem, summary
from kvfence_operator.decisions.pool_gate import PodPool, PoolDecision
from kvfence_operator.decisions.rollout import (
    DISABLED,
    STOPPED,
    Event,
    RevisionObservation,
    RolloutPlan,
)
from kvfence_operator.decisions.standing_canary import StandingPlan

log = logging.getLogger(__name__)

R = ConditionReason
# Degraded reasons that no amount of waiting clears: only a new spec (or the user's action on
# another object) does, so Stalled=True at once. CanaryCouldNotRun: a canary that failed to run
# every bounded retry.
TERMINAL = frozenset(
    {
        R.CANARY_FAILED,
        R.POOL_INSUFFICIENT,
        R.NAME_CONFLICT,
        R.INVALID_SPEC,
        R.CREATE_REJECTED,
        R.CANARY_COULD_NOT_RUN,
        R.REVISION_RECORD_REFUSED,
    }
)
MESSAGE_LIMIT = 1000  # a condition message the operator writes from an error's text


# ---- conditions (metav1.Condition bookkeeping) ---------------------------------------------


def find_condition(conditions: Sequence[Condition], type_: ConditionType | str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def set_condition(
    conditions: Sequence[Condition],
    type_: ConditionType | str,
    status: ConditionStatus,
    reason: ConditionReason | str,
    message: str,
    observed_generation: int,
    now: datetime | None = None,
) -> list[Condition]:
    """Return the list with one condition added or replaced, in place of the old one.

    lastTransitionTime moves only when status flips: a new reason or message for the same
    status is an update, not a transition.
    """
    now = now or datetime.now(UTC)
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (Kubernetes times are UTC)")
    old = find_condition(conditions, type_)
    if old is not None and old.status == status:
        transitioned_at = old.last_transition_time
    else:
        transitioned_at = now.astimezone(UTC).replace(microsecond=0)  # metav1.Time: seconds
    new = Condition(
        type=str(type_),
        status=status,
        reason=reason,
        message=message,
        last_transition_time=transitioned_at,
        observed_generation=observed_generation,
    )
    if old is None:
        return [*conditions, new]
    return [new if c is old else c for c in conditions]


# ---- the status of a full pass -------------------------------------------------------------


T, F, U = ConditionStatus.TRUE, ConditionStatus.FALSE, ConditionStatus.UNKNOWN


def compute_status(
    spec: InferenceDeploymentSpec,
    generation: int,
    previous: InferenceDeploymentStatus,
    plan: RolloutPlan,
    observed: Mapping[str, RevisionObservation],
    pools: list[PodPool],
    endpoint: str | None,
    now: datetime | None = None,
    problems: Sequence[Problem] = (),
    autoscaling: AutoscalingStatus | None = None,
    standing: StandingPlan | None = None,
) -> InferenceDeploymentStatus:
    """`problems`: errors the operator met this pass (Degraded=True with the first's reason);
    `autoscaling`: the autoscaler's (decisions/scaling.py); `standing`: the standing canary's
    (decisions/standing_canary.py), IsolationVerified's source."""
    now = now or datetime.now(UTC)
    judged = observed.get(plan.judged)
    decision = judged.pools if judged else None
    conditions: list[Condition] = list(previous.conditions)

    def put(
        kind: ConditionType, status: ConditionStatus, reason: ConditionReason, message: str
    ) -> None:
        nonlocal conditions
        conditions = set_condition(conditions, kind, status, reason, message, generation, now)

    rolling = plan.revision.candidate is not None
    canary = plan.canary
    if not rolling and plan.revision.current is not None:
        current = plan.revision.current
        canary = serving_canary(canary, current, observed.get(current), spec.canary.enabled)
    # scaled to zero is what the user asked for: said, not an error
    # (a role the autoscaler scales runs at least its minReplicas, at least 1)
    autoscaled = {r for r in ("prefill", "decode") if getattr(autoscaling, r, None) is not None}
    zero = [f"spec.{r}.replicas" for r in ("prefill", "decode", "router")
            if getattr(spec, r).replicas == 0 and r not in autoscaled]  # fmt: skip
    scaled = f"{' and '.join(zero)} {'is' if len(zero) == 1 else 'are'} 0: scaled to zero"

    # PoolSufficient: about the revision being rolled out (or the serving one).
    if zero and (decision is None or decision.reason == R.NO_ENGINE_PODS):
        put(ConditionType.POOL_SUFFICIENT, U, R.SCALED_TO_ZERO, scaled)
    elif decision is None or decision.reason == R.NO_ENGINE_PODS:
        put(ConditionType.POOL_SUFFICIENT, U, R.WAITING_FOR_PODS, "no engine pool reported yet")
    elif decision.sufficient:
        put(ConditionType.POOL_SUFFICIENT, T, decision.reason, decision.message)
    else:
        put(ConditionType.POOL_SUFFICIENT, F, decision.reason, decision.message)

    # the canary that stopped the rollout (failed, or could not run), or None (an object rather
    # than a flag, so branches read its message), and what stopped it
    stopped = canary if canary is not None and canary.result in STOPPED else None
    # read only where `stopped` is (the placeholder never reaches a condition)
    stop_reason, stop_words = (
        STOPPED[stopped.result] if stopped and stopped.result else (R.CANARY_FAILED, "")
    )
    if canary is None or canary.result in (None, CanaryResult.PENDING, CanaryResult.RUNNING):
        message = canary.message if canary and canary.message else "no canary has run"
        put(ConditionType.CANARY_PASSED, U, R.CANARY_PENDING, _about(canary, message))
    elif canary.result is CanaryResult.PASSED:
        put(ConditionType.CANARY_PASSED, T, R.CANARY_PASSED, _about(canary, canary.message or ""))
    elif canary.result is CanaryResult.NOT_RUN and not spec.canary.enabled:
        put(ConditionType.CANARY_PASSED, T, R.CANARY_DISABLED, "spec.canary.enabled is false")
    elif canary.result is CanaryResult.NOT_RUN:
        put(ConditionType.CANARY_PASSED, U, R.CANARY_NOT_RUN, _about(canary, canary.message or ""))
    elif canary.result is CanaryResult.COULD_NOT_RUN:  # no verdict: not a finding
        put(ConditionType.CANARY_PASSED, U, R.CANARY_COULD_NOT_RUN,
            _about(canary, canary.message or ""))  # fmt: skip
    else:
        put(ConditionType.CANARY_PASSED, F, R.CANARY_FAILED, _about(canary, canary.message or ""))

    refused = decision is not None and not decision.sufficient and _all_reported(pools)
    refusal = decision if refused else None  # the refusing decision, read by the branches
    serving = observed.get(plan.serve) if plan.serve else None
    # Ready is a Deployment's "Available": the serving revision serves with at least its
    # minimum available, whatever else is under way (a rollout, a scale-up, a pod restarting)
    available = serving is not None and serving.available
    complete = serving is not None and serving.pods_ready  # every replica too
    # a rollout stopped by its canary, or the serving revision below its minimum available
    candidate_stopped = stopped if rolling else None
    serving_down = plan.serve is not None and not available
    serving_waits = f"revision {plan.serve}: {serving.waiting_for if serving else 'no pods'}"

    # a running canary is bounded by its own Job's deadline, not by the progress deadline
    canary_running = rolling and canary is not None and canary.result is CanaryResult.RUNNING
    waiting = judged.waiting_for if judged else "waiting for pods"
    if canary_running:
        waiting = "its canary is running"
    elif rolling and _canary_held(canary, judged):
        assert canary is not None
        waiting = f"ready, but {canary.message}"
    if candidate_stopped is not None:
        put(ConditionType.PROGRESSING, F, stop_reason,
            _about(candidate_stopped, candidate_stopped.message or ""))  # fmt: skip
    elif refusal is not None:
        put(ConditionType.PROGRESSING, F, R.POOL_INSUFFICIENT, refusal.message)
    elif zero:
        put(ConditionType.PROGRESSING, F, R.SCALED_TO_ZERO, scaled)
    elif rolling:
        put(ConditionType.PROGRESSING, T, R.ROLLOUT_IN_PROGRESS,
            f"revision {plan.revision.candidate}: {waiting}")  # fmt: skip
    elif serving_down:
        put(ConditionType.PROGRESSING, T, R.SERVING_REVISION_UNREADY, serving_waits)
    elif not complete:  # serving, and more of its pods start (a scale-up, a restart)
        put(ConditionType.PROGRESSING, T, R.REPLICAS_STARTING, f"{serving_waits}; it serves")
    else:
        put(ConditionType.PROGRESSING, F, R.ROLLOUT_COMPLETE,
            f"revision {plan.revision.current} serves")  # fmt: skip

    if candidate_stopped is not None:
        put(ConditionType.DEGRADED, T, stop_reason,
            _about(candidate_stopped, candidate_stopped.message or ""))  # fmt: skip
    elif refusal is not None:
        put(ConditionType.DEGRADED, T, R.POOL_INSUFFICIENT, refusal.message)
    elif zero:
        put(ConditionType.DEGRADED, F, R.SCALED_TO_ZERO, scaled)
    elif serving_down:
        put(ConditionType.DEGRADED, T, R.SERVING_REVISION_UNREADY, serving_waits)
    else:
        put(ConditionType.DEGRADED, F, R.AS_EXPECTED, "no fault observed")
    if (met := summary(problems)) is not None:
        put(ConditionType.DEGRADED, T, *met)

    if zero:
        put(ConditionType.READY, F, R.SCALED_TO_ZERO, f"{scaled}; nothing serves")
    elif available:
        put(ConditionType.READY, T, R.SERVING,
            f"revision {plan.serve} serves at {endpoint}"
            + _meanwhile(plan, candidate_stopped, stop_words, refusal))  # fmt: skip
    elif serving_down:
        put(ConditionType.READY, F, R.SERVING_REVISION_UNREADY, f"{serving_waits}; not serving")
    elif candidate_stopped is not None:
        put(ConditionType.READY, F, stop_reason,
            f"revision {plan.revision.candidate} {stop_words}; nothing is served")  # fmt: skip
    elif refusal is not None:
        put(ConditionType.READY, F, R.POOL_INSUFFICIENT, refusal.message)
    else:
        put(ConditionType.READY, F, R.ROLLOUT_IN_PROGRESS,
            f"revision {plan.revision.candidate} is not promoted yet; nothing serves")  # fmt: skip

    # IsolationVerified: only while a standing canary watches the serving revision
    isolation = standing.condition if standing is not None else None
    if isolation is not None:
        put(ConditionType.ISOLATION_VERIFIED, isolation.status, isolation.reason, isolation.message)
    else:
        conditions = [c for c in conditions if c.type != ConditionType.ISOLATION_VERIFIED]

    progressing = _condition(conditions, ConditionType.PROGRESSING)  # as put above: its mirror
    conditions = set_condition(
        conditions,
        ConditionType.RECONCILING,
        progressing.status,
        progressing.reason,
        progressing.message,
        generation,
        now,
    )
    # progress: what the rollout waits for, while it waits for pods or pools
    mark = None
    if progressing.status is T and not canary_running:
        reported = sum(p.report is not None for p in pools)
        mark = f"{progressing.message} (pools reported: {reported}/{len(pools)})"
    progressed = progress(previous.progress, mark, now)
    conditions = stalled(
        conditions, progressed, spec.rollout.progress_deadline_seconds, generation, now
    )

    scope = serving.pools if serving else None
    effective = scope.effective_context if scope else None
    return InferenceDeploymentStatus(
        observed_generation=generation,
        conditions=conditions,
        context_length=ContextLengthStatus(requested=spec.context_length, effective=effective),
        pools=[
            PoolReport(
                pod=p.pod, role=Role(p.role), revision=p.revision, pool_tokens=p.report.pool_tokens
            )
            for p in pools
            if p.report is not None
        ],
        min_pool_tokens=scope.min_pool_tokens if scope else None,
        prefill=serving.replicas.get(Role.PREFILL) if serving else None,
        decode=serving.replicas.get(Role.DECODE) if serving else None,
        router=serving.replicas.get(Role.ROUTER) if serving else None,
        revision=plan.revision,
        canary=canary,
        endpoint=endpoint if plan.serve else None,
        candidate=_candidate(plan.revision.candidate, judged) if rolling else None,
        progress=progressed,
        autoscaling=autoscaling,
        standing_canary=standing.status if standing is not None else None,
    )


def _canary_held(canary: CanaryStatus | None, judged: RevisionObservation | None) -> bool:
    """A candidate ready to be judged whose canary is still Pending: its Job could not be
    created, or the Job of its name is not the operator's (the canary's message says which)."""
    return (
        canary is not None
        and canary.result is CanaryResult.PENDING
        and judged is not None
        and judged.pods_ready
        and judged.pools.sufficient
    )


def stalled(
    conditions: Sequence[Condition],
    progressed: ProgressStatus | None,
    deadline_s: int,
    generation: int,
    now: datetime | None = None,
) -> list[Condition]:
    """Stalled=True only when progress stopped: Degraded with a terminal reason (TERMINAL), or
    no progress for the deadline. Anything else, a pod restarting included, is not a stall."""
    now = now or datetime.now(UTC)
    degraded = _condition(conditions, ConditionType.DEGRADED)
    progressing = _condition(conditions, ConditionType.PROGRESSING)
    if degraded.status is T and degraded.reason in TERMINAL:
        verdict = (T, degraded.reason, degraded.message)
    elif progressed is not None and deadline_exceeded(progressed, deadline_s, now):
        verdict = (T, R.PROGRESS_DEADLINE_EXCEEDED,
                   f"no progress for {deadline_s}s (spec.rollout.progressDeadlineSeconds): "
                   f"{progressed.mark}")  # fmt: skip
    else:
        verdict = (F, progressing.reason, progressing.message)
    return set_condition(conditions, ConditionType.STALLED, *verdict, generation, now)


def _condition(conditions: Sequence[Condition], kind: ConditionType) -> Condition:
    found = find_condition(conditions, kind)
    assert found is not None, kind
    return found


def _candidate(revision: str | None, judged: RevisionObservation | None) -> CandidateStatus:
    if judged is None:
        return CandidateStatus(revision=revision)
    return CandidateStatus(
        revision=revision,
        prefill=judged.replicas.get(Role.PREFILL),
        decode=judged.replicas.get(Role.DECODE),
        router=judged.replicas.get(Role.ROUTER),
        context_length=judged.pools.effective_context,
        min_pool_tokens=judged.pools.min_pool_tokens,
    )


def _meanwhile(
    plan: RolloutPlan, stopped: CanaryStatus | None, stop_words: str, refusal: PoolDecision | None
) -> str:
    """What Ready=True adds about a rollout under way: the candidate, and what stopped it."""
    candidate = plan.revision.candidate
    if candidate is None:
        return ""
    if stopped is not None:
        return f"; revision {candidate} {stop_words}"
    if refusal is not None:
        return f"; revision {candidate} is refused by the pool check"
    return f"; revision {candidate} is rolling out"


def _all_reported(pools: list[PodPool]) -> bool:
    """A pool verdict is final once every pod answered; before that, pods are starting."""
    return bool(pools) and all(p.report is not None for p in pools)


def _about(canary: CanaryStatus | None, message: str) -> str:
    if canary is None or canary.revision is None:
        return message
    return f"revision {canary.revision}: {message}"


def with_conflicts(
    status: InferenceDeploymentStatus,
    conflicts: Sequence[Conflict],
    generation: int,
    now: datetime | None = None,
) -> InferenceDeploymentStatus:
    """A name the operator needs is someone else's object: Ready=False and Degraded=True
    (Stalled mirrors it) with reason NameConflict, naming each object and its controller, and
    no endpoint when the stable Service is not ours. Nothing to say without conflicts."""
    if not conflicts:
        return status
    message = "; ".join(c.message for c in conflicts)
    conditions: list[Condition] = list(status.conditions)
    for kind, value in (
        (ConditionType.READY, F),
        (ConditionType.DEGRADED, T),
        (ConditionType.STALLED, T),
    ):
        conditions = set_condition(
            conditions, kind, value, R.NAME_CONFLICT, message, generation, now
        )
    return status.model_copy(update={"conditions": conditions})


def problem_events(
    previous: InferenceDeploymentStatus, status: InferenceDeploymentStatus, found: Findings
) -> list[Event]:
    """A Warning for each problem when Degraded (as compute_status said it, before any
    conflict) first says it or its message changes, not on every pass."""
    if found.problems and _degraded(previous) != _degraded(status):
        return [Event("Warning", p.reason, p.message) for p in found.problems]
    return []


def pool_events(
    previous: InferenceDeploymentStatus, status: InferenceDeploymentStatus
) -> list[Event]:
    """One Warning `PoolInsufficient` when the pool check refuses a revision (every pod
    reported, and a pool cannot serve), with the refusal's findings and remedy, as
    Progressing says it: once when the refusal appears or its message changes, not on every
    pass, and once for the revision, not once per pod (pods.gate_event_due)."""
    now = _refusal(status)
    if now is not None and now != _refusal(previous):
        return [Event("Warning", R.POOL_INSUFFICIENT, now)]
    return []


def _refusal(status: InferenceDeploymentStatus) -> str | None:
    progressing = find_condition(status.conditions, ConditionType.PROGRESSING)
    if progressing is None or progressing.reason != R.POOL_INSUFFICIENT:
        return None
    return progressing.message


def conflict_events(
    previous: InferenceDeploymentStatus, status: InferenceDeploymentStatus, found: Findings
) -> list[Event]:
    """A Warning for each conflict when a NameConflict first appears or changes."""
    conflicts = found.unique_conflicts()
    if conflicts and _degraded_message(previous, R.NAME_CONFLICT) != _degraded_message(
        status, R.NAME_CONFLICT
    ):
        return [Event("Warning", R.NAME_CONFLICT, c.message) for c in conflicts]
    return []


def _degraded(status: InferenceDeploymentStatus) -> tuple[str, str] | None:
    degraded = find_condition(status.conditions, ConditionType.DEGRADED)
    return (degraded.reason, degraded.message) if degraded is not None else None


def _degraded_message(status: InferenceDeploymentStatus, reason: ConditionReason) -> str | None:
    degraded = find_condition(status.conditions, ConditionType.DEGRADED)
    return degraded.message if degraded is not None and degraded.reason == reason else None


# ---- the status of a pass that stops early ----------------------------------------------------


def degraded_conditions(
    previous: InferenceDeploymentStatus, reason: ConditionReason, message: str, generation: int
) -> list[Condition]:
    """Degraded True with `reason` and `message`, every other condition as it was: a pass that
    stops before it decides anything else (the credentials it may not read) leaves Ready and
    the rest as the last full pass left them."""
    return set_condition(
        previous.conditions, ConditionType.DEGRADED, T, reason, message[:MESSAGE_LIMIT], generation
    )


def invalid_spec_conditions(
    previous: InferenceDeploymentStatus, message: str, generation: int
) -> list[Condition]:
    """A spec the CRD let through that does not validate: not Ready, Degraded and Stalled."""
    conditions: list[Condition] = list(previous.conditions)
    for kind, value in (
        (ConditionType.READY, F),
        (ConditionType.DEGRADED, T),
        (ConditionType.STALLED, T),
    ):
        conditions = set_condition(
            conditions, kind, value, R.INVALID_SPEC, message[:MESSAGE_LIMIT], generation
        )
    return conditions


# ---- the parts the status is computed from --------------------------------------------------


def serving_canary(
    canary: CanaryStatus | None,
    current: str,
    observed: RevisionObservation | None,
    canary_enabled: bool,
) -> CanaryStatus | None:
    """The canary status when nothing rolls: about `current`, the revision that serves. A
    status about another revision (a candidate that failed its canary and was reverted) says
    nothing about it; `current` passed its canary to be promoted (its Job is kept with it), or
    canaries are disabled."""
    if canary is not None and canary.revision == current:
        return canary
    if not canary_enabled:
        return CanaryStatus(revision=current, result=CanaryResult.NOT_RUN, message=DISABLED)
    outcome = observed.canary if observed is not None else None
    if outcome is None:
        return CanaryStatus(
            revision=current,
            result=CanaryResult.PASSED,
            message="promoted after its canary (its Job is gone)",
        )
    result = {
        JobPhase.SUCCEEDED: CanaryResult.PASSED,
        JobPhase.FAILED: CanaryResult.FAILED,
        JobPhase.RUNNING: CanaryResult.RUNNING,
    }[outcome.phase]
    return CanaryStatus(
        revision=current, job=outcome.job, result=result, message=outcome.message or str(result)
    )


def progress(
    previous: ProgressStatus | None, mark: str | None, now: datetime
) -> ProgressStatus | None:
    """None when nothing is under way; else when `mark` (what the rollout waits for) last
    changed. Any change is progress: a pod becoming ready, or unready again."""
    if mark is None:
        return None
    if previous is not None and previous.mark == mark:
        return previous
    return ProgressStatus(mark=mark, last_progress_time=now)


def deadline_exceeded(progressed: ProgressStatus | None, deadline_s: int, now: datetime) -> bool:
    return progressed is not None and now - progressed.last_progress_time > timedelta(
        seconds=deadline_s
    )


def read_status(raw: Mapping[str, Any] | None, name: str) -> InferenceDeploymentStatus:
    """The status as stored. One that does not parse (an older operator's, or edited by hand)
    must not stop reconciliation: start from an empty one, and say so in the log."""
    try:
        return InferenceDeploymentStatus.model_validate(raw or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        log.warning(
            "%s: the stored status does not parse (status.%s: %s); starting from an empty status",
            name,
            ".".join(str(p) for p in first["loc"]),
            first["msg"],
        )
        return InferenceDeploymentStatus()


# ---- writing it -----------------------------------------------------------------------------


def merged(target: Any, patch: Any) -> Any:
    """`patch` applied to `target` as a JSON merge patch (RFC 7386) is applied."""
    if not isinstance(patch, Mapping):
        return patch
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merged(result.get(key), value)
    return result


def status_changes(current: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Would merging `new` into the stored status change it?"""
    held = dict(current or {})
    return bool(merged(held, new) != held)
