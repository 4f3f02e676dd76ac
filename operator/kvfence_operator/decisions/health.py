"""What the status must not get wrong, as small pure decisions that compute_status and the
reconcile pass apply: which pods are engines at all, which canary the serving revision
passed, the errors the operator met, and when a rollout has stalled (not merely paused).

Stalled is True only when progress stopped: a terminal verdict (TERMINAL) or no progress for
spec.rollout.progressDeadlineSeconds. A pod that restarts once is progress, not a stall.
"""

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from kvfence_operator.cluster.kube import KubeError
from kvfence_operator.crd.types import (
    CanaryResult,
    CanaryStatus,
    InferenceDeploymentStatus,
    ProgressStatus,
)
from kvfence_operator.decisions.rollout import DISABLED, JobPhase, RevisionObservation

log = logging.getLogger(__name__)

# Degraded reasons that no amount of waiting clears: only a new spec (or the user's action on
# another object) does, so Stalled=True at once. CanaryCouldNotRun: a canary that failed to run
# every bounded retry.
TERMINAL = frozenset(
    {
        "CanaryFailed",
        "PoolInsufficient",
        "NameConflict",
        "InvalidSpec",
        "CreateRejected",
        "CanaryCouldNotRun",
    }
)
DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
CREATE_FAILED = "CreateFailed"  # the API refused to create a child (quota 403, webhook, ...)
CREATE_REJECTED = "CreateRejected"  # 422: the spec makes children the API server rejects
API_KEYS_SECRET_MISSING = "ApiKeysSecretMissing"
TERMINAL_PHASES = ("Failed", "Succeeded")


class InvalidSpec(ValueError):
    """The spec does not validate (a CRD older than the operator, or a cluster without CEL):
    the only ValidationError reported as InvalidSpec."""


class CredentialsUnreadable(RuntimeError):
    """A revision an older operator made keeps random credentials in its Secret, and this
    operator may not read it (no Secret `get`: the chart's rbac.legacyRevisionSecrets is
    off). The pass stops before it probes or gates anything, so the revision's pods keep the
    gates they have (a probe without the token would close them all); Degraded says why."""

    def __init__(self, revision: str, secret: str) -> None:
        super().__init__(
            f"revision {revision} was made by an older operator: its credentials are in Secret "
            f"{secret}, which this operator may not read (403); set the chart's "
            "rbac.legacyRevisionSecrets=true until every InferenceDeployment has rolled. "
            "Nothing is changed meanwhile: its pods keep their gates and its routers their "
            "backends"
        )
        self.revision = revision


def may_serve(pod: Mapping[str, Any]) -> bool:
    """A pod that can serve: not being deleted, not finished. An evicted pod (phase Failed,
    no IP) stays until pod GC, but is no engine of its revision: not probed, gated or counted;
    nor is its address given to a router or pushed to (its IP may be another pod's now)."""
    if pod["metadata"].get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") not in TERMINAL_PHASES


@dataclass(frozen=True, slots=True)
class Problem:
    """An error the operator met this pass, for Degraded and an Event."""

    reason: str
    message: str


def api_message(exc: KubeError) -> str:
    """The API server's own message from a Status body, else the error's text."""
    try:
        body = json.loads(exc.body)
    except ValueError:
        return str(exc)
    message = body.get("message") if isinstance(body, dict) else None
    return str(message) if message else str(exc)


def create_problem(kind: str, name: str, exc: KubeError) -> Problem:
    reason = CREATE_REJECTED if exc.status == 422 else CREATE_FAILED
    return Problem(reason, f"cannot create {kind} {name} ({exc.status}): {api_message(exc)}")


def keys_secret_problem(name: str, namespace: str) -> Problem:
    return Problem(
        API_KEYS_SECRET_MISSING,
        f"Secret {name} (spec.router.apiKeysSecret) does not exist in namespace {namespace}: "
        "the routers cannot start until it does",
    )


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


def summary(problems: Sequence[Problem]) -> tuple[str, str] | None:
    """Degraded's (reason, message) for this pass's problems: the first one's reason."""
    if not problems:
        return None
    return problems[0].reason, "; ".join(dict.fromkeys(p.message for p in problems))
