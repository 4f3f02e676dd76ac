"""The InferenceDeployment's status, computed from a rollout plan and what was observed.

Pure: the same inputs give the same status, and conditions keep their lastTransitionTime
unless their status flips (conditions.set_condition).
"""

from collections.abc import Mapping, Sequence
from datetime import datetime

from kvfence_operator.conditions import set_condition
from kvfence_operator.crd.types import (
    CanaryResult,
    CanaryStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    ContextLengthStatus,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    PoolReport,
    Role,
)
from kvfence_operator.ownership import NAME_CONFLICT, Conflict
from kvfence_operator.pool_gate import PodPool
from kvfence_operator.rollout import STOPPED, RevisionObservation, RolloutPlan

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
) -> InferenceDeploymentStatus:
    judged = observed.get(plan.judged)
    decision = judged.pools if judged else None
    conditions: list[Condition] = list(previous.conditions)

    def put(kind: ConditionType, status: ConditionStatus, reason: str, message: str) -> None:
        nonlocal conditions
        conditions = set_condition(conditions, kind, status, reason, message, generation, now)

    # PoolSufficient: about the revision being rolled out (or the serving one).
    if decision is None or decision.reason == "NoEnginePods":
        put(ConditionType.POOL_SUFFICIENT, U, "WaitingForPods", "no engine pool reported yet")
    elif decision.sufficient:
        put(ConditionType.POOL_SUFFICIENT, T, decision.reason, decision.message)
    else:
        put(ConditionType.POOL_SUFFICIENT, F, decision.reason, decision.message)

    canary = plan.canary
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

    rolling = plan.revision.candidate is not None
    refused = decision is not None and not decision.sufficient and _all_reported(pools)
    refusal = decision if refused else None  # the refusing decision, read by the branches
    serving = observed.get(plan.serve) if plan.serve else None
    serving_ready = serving is not None and serving.pods_ready and serving.pools.sufficient

    if stopped is not None and rolling:
        put(ConditionType.PROGRESSING, F, stop_reason,
            _about(stopped, stopped.message or ""))  # fmt: skip
    elif refusal is not None:
        put(ConditionType.PROGRESSING, F, "PoolInsufficient", refusal.message)
    elif rolling:
        waiting = judged.waiting_for if judged else "waiting for pods"
        put(ConditionType.PROGRESSING, T, "RolloutInProgress",
            f"revision {plan.revision.candidate}: {waiting}")  # fmt: skip
    else:
        put(ConditionType.PROGRESSING, F, "RolloutComplete",
            f"revision {plan.revision.current} serves")  # fmt: skip

    if stopped is not None and rolling:
        put(ConditionType.DEGRADED, T, stop_reason,
            _about(stopped, stopped.message or ""))  # fmt: skip
    elif refusal is not None:
        put(ConditionType.DEGRADED, T, "PoolInsufficient", refusal.message)
    elif plan.serve is not None and not serving_ready and not rolling:
        put(ConditionType.DEGRADED, T, "ServingRevisionUnready",
            f"revision {plan.serve}: {serving.waiting_for if serving else 'no pods'}")  # fmt: skip
    else:
        put(ConditionType.DEGRADED, F, "AsExpected", "no fault observed")

    if not rolling and serving_ready:
        put(ConditionType.READY, T, "Serving", f"revision {plan.serve} serves at {endpoint}")
    elif stopped is not None and rolling:
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

    for source, mirror in (
        (ConditionType.PROGRESSING, ConditionType.RECONCILING),
        (ConditionType.DEGRADED, ConditionType.STALLED),
    ):
        c = next(c for c in conditions if c.type == source)
        put(mirror, c.status, c.reason, c.message)

    effective = decision.effective_context if decision else None
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
        min_pool_tokens=decision.min_pool_tokens if decision else None,
        prefill=judged.replicas.get(Role.PREFILL) if judged else None,
        decode=judged.replicas.get(Role.DECODE) if judged else None,
        router=judged.replicas.get(Role.ROUTER) if judged else None,
        revision=plan.revision,
        canary=plan.canary,
        endpoint=endpoint if plan.serve else None,
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
