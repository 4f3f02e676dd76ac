"""The InferenceDeployment's status, computed from a rollout plan and what was observed.

Pure: the same inputs give the same status, and conditions keep their lastTransitionTime
unless their status flips (conditions.set_condition).
"""

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from kvfence_operator.crd.types import (
    CanaryResult,
    CanaryStatus,
    CandidateStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    ContextLengthStatus,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    PoolReport,
    ProgressStatus,
    Role,
)
from kvfence_operator.decisions.conditions import find_condition, set_condition
from kvfence_operator.decisions.health import (
    DEADLINE_EXCEEDED,
    TERMINAL,
    Problem,
    deadline_exceeded,
    progress,
    serving_canary,
    summary,
)
from kvfence_operator.decisions.ownership import NAME_CONFLICT, Conflict
from kvfence_operator.decisions.pool_gate import PodPool
from kvfence_operator.decisions.rollout import STOPPED, RevisionObservation, RolloutPlan

T, F, U = ConditionStatus.TRUE, ConditionStatus.FALSE, ConditionStatus.UNKNOWN
SCALED_TO_ZERO = "ScaledToZero"


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
) -> InferenceDeploymentStatus:
    """`problems`: errors the operator met this pass (Degraded=True with the first's reason)."""
    now = now or datetime.now(UTC)
    judged = observed.get(plan.judged)
    decision = judged.pools if judged else None
    conditions: list[Condition] = list(previous.conditions)

    def put(kind: ConditionType, status: ConditionStatus, reason: str, message: str) -> None:
        nonlocal conditions
        conditions = set_condition(conditions, kind, status, reason, message, generation, now)

    rolling = plan.revision.candidate is not None
    canary = plan.canary
    if not rolling and plan.revision.current is not None:
        current = plan.revision.current
        canary = serving_canary(canary, current, observed.get(current), spec.canary.enabled)
    # scaled to zero is what the user asked for: said, not an error
    zero = [f"spec.{r}.replicas" for r in ("prefill", "decode", "router")
            if getattr(spec, r).replicas == 0]  # fmt: skip
    scaled = f"{' and '.join(zero)} {'is' if len(zero) == 1 else 'are'} 0: scaled to zero"

    # PoolSufficient: about the revision being rolled out (or the serving one).
    if zero and (decision is None or decision.reason == "NoEnginePods"):
        put(ConditionType.POOL_SUFFICIENT, U, SCALED_TO_ZERO, scaled)
    elif decision is None or decision.reason == "NoEnginePods":
        put(ConditionType.POOL_SUFFICIENT, U, "WaitingForPods", "no engine pool reported yet")
    elif decision.sufficient:
        put(ConditionType.POOL_SUFFICIENT, T, decision.reason, decision.message)
    else:
        put(ConditionType.POOL_SUFFICIENT, F, decision.reason, decision.message)

    # the canary that stopped the rollout (failed, or could not run), or None (an object rather
    # than a flag, so branches read its message), and what stopped it
    stopped = canary if canary is not None and canary.result in STOPPED else None
    stop_reason, stop_words = STOPPED[stopped.result] if stopped and stopped.result else ("", "")
    if canary is None or canary.result in (None, CanaryResult.PENDING, CanaryResult.RUNNING):
        message = canary.message if canary and canary.message else "no canary has run"
        put(ConditionType.CANARY_PASSED, U, "CanaryPending", _about(canary, message))
    elif canary.result is CanaryResult.PASSED:
        put(ConditionType.CANARY_PASSED, T, "CanaryPassed", _about(canary, canary.message or ""))
    elif canary.result is CanaryResult.NOT_RUN and not spec.canary.enabled:
        put(ConditionType.CANARY_PASSED, T, "CanaryDisabled", "spec.canary.enabled is false")
    elif canary.result is CanaryResult.NOT_RUN:
        put(ConditionType.CANARY_PASSED, U, "CanaryNotRun", _about(canary, canary.message or ""))
    elif canary.result is CanaryResult.COULD_NOT_RUN:  # no verdict: not a finding
        put(ConditionType.CANARY_PASSED, U, stop_reason, _about(canary, canary.message or ""))
    else:
        put(ConditionType.CANARY_PASSED, F, "CanaryFailed", _about(canary, canary.message or ""))

    refused = decision is not None and not decision.sufficient and _all_reported(pools)
    refusal = decision if refused else None  # the refusing decision, read by the branches
    serving = observed.get(plan.serve) if plan.serve else None
    serving_ready = serving is not None and serving.pods_ready and serving.pools.sufficient
    # a rollout stopped by its canary, or the serving revision down while nothing rolls
    candidate_stopped = stopped if rolling else None
    serving_down = plan.serve is not None and not serving_ready and not rolling

    # a running canary is bounded by its own Job's deadline, not by the progress deadline
    canary_running = rolling and canary is not None and canary.result is CanaryResult.RUNNING
    waiting = judged.waiting_for if judged else "waiting for pods"
    if canary_running:
        waiting = "its canary is running"
    if candidate_stopped is not None:
        put(ConditionType.PROGRESSING, F, stop_reason,
            _about(candidate_stopped, candidate_stopped.message or ""))  # fmt: skip
    elif refusal is not None:
        put(ConditionType.PROGRESSING, F, "PoolInsufficient", refusal.message)
    elif zero:
        put(ConditionType.PROGRESSING, F, SCALED_TO_ZERO, scaled)
    elif rolling:
        put(ConditionType.PROGRESSING, T, "RolloutInProgress",
            f"revision {plan.revision.candidate}: {waiting}")  # fmt: skip
    elif serving_down:
        put(ConditionType.PROGRESSING, T, "ServingRevisionUnready",
            f"revision {plan.serve}: {serving.waiting_for if serving else 'no pods'}")  # fmt: skip
    else:
        put(ConditionType.PROGRESSING, F, "RolloutComplete",
            f"revision {plan.revision.current} serves")  # fmt: skip

    if candidate_stopped is not None:
        put(ConditionType.DEGRADED, T, stop_reason,
            _about(candidate_stopped, candidate_stopped.message or ""))  # fmt: skip
    elif refusal is not None:
        put(ConditionType.DEGRADED, T, "PoolInsufficient", refusal.message)
    elif zero:
        put(ConditionType.DEGRADED, F, SCALED_TO_ZERO, scaled)
    elif serving_down:
        put(ConditionType.DEGRADED, T, "ServingRevisionUnready",
            f"revision {plan.serve}: {serving.waiting_for if serving else 'no pods'}")  # fmt: skip
    else:
        put(ConditionType.DEGRADED, F, "AsExpected", "no fault observed")
    if (met := summary(problems)) is not None:
        put(ConditionType.DEGRADED, T, *met)

    if not rolling and serving_ready:
        put(ConditionType.READY, T, "Serving", f"revision {plan.serve} serves at {endpoint}")
    elif zero:
        put(ConditionType.READY, F, SCALED_TO_ZERO, f"{scaled}; nothing serves")
    elif candidate_stopped is not None:
        keeps = f"revision {plan.serve} keeps serving" if plan.serve else "nothing is served"
        put(ConditionType.READY, F, stop_reason,
            f"revision {plan.revision.candidate} {stop_words}; {keeps}")  # fmt: skip
    elif refusal is not None:
        put(ConditionType.READY, F, "PoolInsufficient", refusal.message)
    elif rolling:
        put(ConditionType.READY, F, "RolloutInProgress",
            f"revision {plan.revision.candidate} is not promoted yet")  # fmt: skip
    else:
        put(ConditionType.READY, F, "ServingRevisionUnready",
            f"revision {plan.serve} is not ready")  # fmt: skip

    progressing = _condition(conditions, ConditionType.PROGRESSING)
    put(ConditionType.RECONCILING, progressing.status, progressing.reason, progressing.message)
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
        verdict = (T, DEADLINE_EXCEEDED,
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
        conditions = set_condition(conditions, kind, value, NAME_CONFLICT, message, generation, now)
    return status.model_copy(update={"conditions": conditions})
