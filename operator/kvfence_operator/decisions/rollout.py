"""The rollout state machine, as one pure function from what was observed to what to do.

All state it needs is in the InferenceDeployment's status (current and candidate revision, the
canary's result), so an operator restarted at any point makes the same decision again. The
kopf handlers and `kvfence up` both call `plan_rollout`; neither decides on its own.
"""

import hmac
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from kvfence_operator.builders.disruption_budget import MAX_UNAVAILABLE
from kvfence_operator.builders.secret import serving_seal
from kvfence_operator.crd.types import (
    CanaryResult,
    CanaryStatus,
    ConditionReason,
    EventReason,
    RevisionStatus,
    RoleReplicas,
)
from kvfence_operator.decisions.canary import CanaryOutcome, JobPhase
from kvfence_operator.decisions.pool_gate import PoolDecision
from kvfence_operator.decisions.retirement import drain
from kvfence_operator.meta import ANNOTATION_SERVING, LABEL_REVISION, Instance, controlled_by
from kvfence_operator.revision import REVISION_LENGTH

DISABLED = "canary disabled in spec"
REFUSED = "not run: the pool check refused this revision"


# Canary results that stop a rollout: the reason its Event and conditions carry, and what
# they say about the candidate (status.py words its conditions with the same)
STOPPED = {
    CanaryResult.FAILED: (ConditionReason.CANARY_FAILED, "failed its canary"),
    CanaryResult.COULD_NOT_RUN: (ConditionReason.CANARY_COULD_NOT_RUN, "could not run its canary"),
}
STOPPED_BY = {
    JobPhase.FAILED: CanaryResult.FAILED,
    JobPhase.COULD_NOT_RUN: CanaryResult.COULD_NOT_RUN,
}


@dataclass(frozen=True, slots=True)
class RevisionObservation:
    """One revision's children as observed this pass."""

    revision: str
    replicas: Mapping[str, RoleReplicas]  # prefill, decode, router
    pools: PoolDecision
    canary: CanaryOutcome | None = None
    # an autoscaled role's least count (its minReplicas, or less when it runs fewer): a
    # scale-up's pods still starting leave it available (scaling is not a rollout)
    floors: Mapping[str, int] = field(default_factory=dict)

    @property
    def pods_ready(self) -> bool:
        """Every replica of every role ready: what promotion waits for."""
        return all(r.desired > 0 and r.ready >= r.desired for r in self.replicas.values())

    @property
    def available(self) -> bool:
        """A Deployment's "Available": each role serves with at least its minimum available,
        one pod and no more than MAX_UNAVAILABLE (the PodDisruptionBudgets') short of its
        replicas. An engine pod counts as ready only once its kv-pool gate is True (a
        readiness gate), so a pod still starting or refused by the pool check is not one."""
        return all(
            r.desired > 0 and r.ready >= max(1, self.floors.get(role, r.desired) - MAX_UNAVAILABLE)
            for role, r in self.replicas.items()
        )

    @property
    def waiting_for(self) -> str:
        late = [f"{role} {r.ready}/{r.desired}" for role, r in self.replicas.items()]
        return "ready replicas: " + ", ".join(late)


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # Normal | Warning
    reason: ConditionReason | EventReason | str  # str: a pod gate's reason, as judge_pools says
    message: str


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    revision: RevisionStatus
    canary: CanaryStatus | None
    keep: tuple[str, ...]  # revisions whose children must exist; every other one goes
    start_canary: str | None  # revision whose canary Job must be created now
    serve: str | None  # revision the stable Service selects
    judged: str  # revision whose pools and readiness the conditions describe
    events: list[Event] = field(default_factory=list)


def selected_revision(service: Mapping[str, Any] | None, uid: str) -> str | None:
    """The revision a stable Service selects, if it is this InferenceDeployment's (controlled
    by `uid`); None for no Service, someone else's, or one without a revision in its selector."""
    if service is None:
        return None
    owners = (service.get("metadata") or {}).get("ownerReferences") or []
    if not any(o.get("uid") == uid and o.get("controller") for o in owners):
        return None
    return ((service.get("spec") or {}).get("selector") or {}).get(LABEL_REVISION)


def sealed_revision(
    service: Mapping[str, Any] | None,
    instance: Instance,
    secret: Callable[[str], bytes | None],
) -> str | None:
    """The revision the operator's seal on its stable Service names (meta.ANNOTATION_SERVING),
    if the Service is this InferenceDeployment's and the seal verifies: `secret(revision)` is
    what sealed it (the credentials key, or that revision's internal token; None: it cannot be
    verified). The selector says nothing here: anyone who may patch the Service can write it,
    no one but the operator can seal."""
    if service is None or not controlled_by(service, instance.uid):
        return None
    annotations = (service.get("metadata") or {}).get("annotations") or {}
    seal = str(annotations.get(ANNOTATION_SERVING) or "")
    revision, colon, _ = seal.partition(":")
    if not colon or not re.fullmatch(f"[0-9a-f]{{{REVISION_LENGTH}}}", revision):
        return None  # not a revision's name: nothing is read for it
    key = secret(revision)
    if key is None:
        return None
    return revision if hmac.compare_digest(seal, serving_seal(key, instance, revision)) else None


def serving_revision(status: RevisionStatus | None, sealed: str | None) -> RevisionStatus | None:
    """The revision status a pass starts from. Status is the operator's record of which
    revision serves: the stable Service's selector is not (anyone who may patch the Service
    could otherwise promote a candidate its canary never passed); a selector that disagrees is
    drift, put back. Only a status that names no serving revision (lost: a backup restored
    without it) is recovered, from what the operator itself wrote and can verify: `sealed`,
    the revision its seal on the stable Service names (sealed_revision). A candidate in the
    status is kept as it is. Without a seal nothing is recovered (the first rollout again)."""
    if sealed is None or (status is not None and status.current is not None):
        return status
    candidate = status.candidate if status is not None else None
    return RevisionStatus(
        current=sealed,
        candidate=candidate if candidate != sealed else None,
        retiring=status.retiring if status is not None else None,
    )


def plan_rollout(
    desired: str,
    previous: RevisionStatus | None,
    previous_canary: CanaryStatus | None,
    observed: Mapping[str, RevisionObservation],
    canary_enabled: bool,
    *,
    now: datetime | None = None,
    retire_after_seconds: int = 0,
) -> RolloutPlan:
    """desired: the spec's revision. A new revision is promoted only when its pods are Ready,
    every pool suffices, and its canary passed (or canaries are disabled). The revision it
    replaces keeps running (is kept, and listed in `revision.retiring`) until
    `retire_after_seconds` have passed since `now` at the promotion (retirement.drain)."""
    plan = _plan_serving(
        desired, previous, previous_canary, observed, canary_enabled, retire_after_seconds
    )
    draining, drained = drain(
        previous, plan.revision, now=now, retire_after_seconds=retire_after_seconds
    )
    events = [
        Event("Normal", EventReason.RETIRED, f"revision {r.revision} drained and is removed")
        for r in drained
    ]
    return replace(
        plan,
        revision=plan.revision.model_copy(update={"retiring": list(draining) or None}),
        keep=(*plan.keep, *(r.revision for r in draining)),
        events=[*plan.events, *events],
    )


def _plan_serving(
    desired: str,
    previous: RevisionStatus | None,
    previous_canary: CanaryStatus | None,
    observed: Mapping[str, RevisionObservation],
    canary_enabled: bool,
    retire_after_seconds: int,
) -> RolloutPlan:
    """Which revision serves, which is rolled out, and what its canary says."""
    current = previous.current if previous else None
    candidate = desired if desired != current else None
    events: list[Event] = []
    if previous is not None and candidate is not None and previous.candidate != candidate:
        events.append(Event("Normal", EventReason.ROLLOUT_STARTED, f"new revision {candidate}"))
    if candidate is None:
        assert current is not None
        return RolloutPlan(
            RevisionStatus(current=current, candidate=None),
            previous_canary,
            (current,),
            None,
            current,
            current,
            events,
        )

    keep = tuple(r for r in (current, candidate) if r is not None)
    seen = observed.get(candidate)
    canary = _carried(previous_canary, candidate)
    if not canary_enabled:
        canary = CanaryStatus(revision=candidate, result=CanaryResult.NOT_RUN, message=DISABLED)
    elif seen is not None and seen.pools.refused and _not_started(canary):
        canary = CanaryStatus(revision=candidate, result=CanaryResult.NOT_RUN, message=REFUSED)

    def stay(canary_status: CanaryStatus | None, start: str | None = None) -> RolloutPlan:
        return RolloutPlan(
            RevisionStatus(current=current, candidate=candidate),
            canary_status,
            keep,
            start,
            current,
            candidate,
            events,
        )

    if seen is None or not seen.pods_ready or not seen.pools.sufficient:
        return stay(canary)
    if not canary_enabled:
        assert canary is not None  # NotRun, set above
        return _promote(candidate, current, canary, events, retire_after_seconds)
    outcome = seen.canary
    if kept_verdict(canary, outcome):
        return stay(canary)
    if outcome is not None and outcome.phase is JobPhase.NOT_BUILT_HERE:
        return stay(
            CanaryStatus(
                revision=candidate,
                job=outcome.job,
                result=CanaryResult.PENDING,
                message=f"Job {outcome.job} is not the canary Job the operator built "
                f"({outcome.message}): it has no verdict; delete it",
            )
        )
    if outcome is None:
        events.append(
            Event("Normal", EventReason.CANARY_STARTED, f"canary job for revision {candidate}")
        )
        return stay(
            CanaryStatus(revision=candidate, result=CanaryResult.RUNNING, message="starting"),
            start=candidate,
        )
    ids = {"job": outcome.job, "job_uid": outcome.uid, "rerun": outcome.rerun}
    if outcome.phase is JobPhase.RUNNING:
        return stay(
            CanaryStatus(revision=candidate, result=CanaryResult.RUNNING, message="running", **ids)
        )
    if outcome.phase in STOPPED_BY:
        result = STOPPED_BY[outcome.phase]
        reason, what = STOPPED[result]
        stopped = CanaryStatus(
            revision=candidate,
            result=result,
            message=outcome.message or "the canary job failed",
            **ids,
        )
        if canary is None or canary.result is not result:
            events.append(
                Event(
                    "Warning",
                    reason,
                    f"revision {candidate} {what}: {stopped.message}; "
                    + (f"revision {current} keeps serving" if current else "nothing is served"),
                )
            )
        return stay(stopped)
    passed = CanaryStatus(
        revision=candidate, result=CanaryResult.PASSED, message=outcome.message or "passed", **ids
    )
    events.append(
        Event("Normal", EventReason.CANARY_PASSED, f"revision {candidate} passed its canary")
    )
    return _promote(candidate, current, passed, events, retire_after_seconds)


def canary_refused(plan: RolloutPlan, refusal: str) -> RolloutPlan:
    """The plan as it stands when the API refused the canary Job it starts (`refusal`: what
    the API answered): no canary started, so none is said to have (no CanaryStarted) and the
    candidate's canary is Pending with the refusal, not Running. A Running canary is bounded
    by its Job's deadline; a Pending one by the progress deadline, so a refusal that lasts
    (a quota never raised) ends Stalled. The Job is tried again each pass."""
    assert plan.start_canary is not None
    canary = CanaryStatus(
        revision=plan.start_canary,
        result=CanaryResult.PENDING,
        message=f"its canary Job could not be created ({refusal}); tried again each pass",
    )
    events = [e for e in plan.events if e.reason is not EventReason.CANARY_STARTED]
    return replace(plan, canary=canary, start_canary=None, events=events)


def kept_verdict(canary: CanaryStatus | None, outcome: CanaryOutcome | None) -> bool:
    """Whether the candidate's verdict in status stands whatever its Job says now: a failed
    canary, or one that could not run, is never forgotten because its Job is gone (the TTL
    controller, a cleanup) nor changed by another Job of the same name (its uid is not the
    one the verdict came from). Only a new revision or a new kvfence.dev/rerun-canary value
    (decide: the verdict is then not carried) runs the canary again."""
    if canary is None or canary.result not in STOPPED:
        return False
    if outcome is None:
        return True
    return canary.job_uid is not None and outcome.uid != canary.job_uid


def _not_started(canary: CanaryStatus | None) -> bool:
    return canary is None or canary.result in (None, CanaryResult.PENDING, CanaryResult.NOT_RUN)


def _carried(previous: CanaryStatus | None, candidate: str) -> CanaryStatus | None:
    """A canary status about another revision says nothing about this candidate."""
    if previous is not None and previous.revision == candidate:
        return previous
    return CanaryStatus(revision=candidate, result=CanaryResult.PENDING, message="waiting for pods")


def _promote(
    candidate: str,
    current: str | None,
    canary: CanaryStatus,
    events: list[Event],
    retire_after_seconds: int,
) -> RolloutPlan:
    retired = ""
    if current is not None:
        later = f"drains for {retire_after_seconds} s, then " if retire_after_seconds else ""
        retired = f"; revision {current} {later}is removed"
    events.append(
        Event("Normal", EventReason.PROMOTED, f"revision {candidate} now serves{retired}")
    )
    return RolloutPlan(
        RevisionStatus(current=candidate, candidate=None),
        canary,
        (candidate,),
        None,
        candidate,
        candidate,
        events,
    )
