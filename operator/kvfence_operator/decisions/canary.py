"""The canary's part of a rollout that is read off its Job: the verdict of a finished Job, and
whether the user asked for a new run.

Only exit 1 is a finding (the Job's podFailurePolicy fails it at once); a Job that failed
otherwise has no verdict (CouldNotRun). A canary that failed or could not run stops the rollout
until the spec changes. When the cause was outside the revision (a node, the network, an image
registry) the user asks for a new run by giving the InferenceDeployment's
`kvfence.dev/rerun-canary` annotation a new value. The canary Job records the value it was
created with; when the two differ, the operator deletes the candidate's Job (its pods with it)
and starts a fresh one. Only a candidate's canary is re-run: the serving revision's passed
canary never is.
"""

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvfence_engine.contracts import IMPLICATED_BACKENDS
from kvfence_operator.builders.canary_job import CONTAINER as CANARY_CONTAINER
from kvfence_operator.builders.canary_job import EXIT_FINDING
from kvfence_operator.decisions.drift import holds
from kvfence_operator.meta import ANNOTATION_RERUN_CANARY


class JobPhase(StrEnum):
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"  # a finding: the canary saw an isolation or status failure
    COULD_NOT_RUN = "CouldNotRun"  # no verdict, after the Job's retries: not a finding
    # a Job with the canary's name and this InferenceDeployment's ownerReference that is not
    # the one the operator builds (job_mismatch): never a verdict, a NameConflict
    NOT_BUILT_HERE = "NotBuiltHere"


@dataclass(frozen=True, slots=True)
class CanaryOutcome:
    job: str
    phase: JobPhase
    message: str = ""
    uid: str | None = None  # the Job's: a verdict in status names the Job it came from
    rerun: str = ""  # the kvfence.dev/rerun-canary value the Job was created with
    # the backend URLs whose isolation counters rose during the run, as its termination
    # message names them (contracts.IMPLICATED_BACKENDS)
    implicated: tuple[str, ...] = ()


def rerun_value(obj: Mapping[str, Any] | None) -> str:
    """The annotation's value on an InferenceDeployment or a canary Job; "" when absent (so a
    Job created before the annotation existed, or while it was unset, matches no value)."""
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(ANNOTATION_RERUN_CANARY) or "")


def rerun_requested(job: Mapping[str, Any], wanted: str) -> bool:
    """Did the user ask for a new run since `job` was created? `wanted`: the
    InferenceDeployment's value."""
    return rerun_value(job) != wanted


def canary_outcome(job: Mapping[str, Any], pods: list[dict[str, Any]]) -> CanaryOutcome:
    """A Job's verdict, with the canary's one-line summary from its termination message.

    Only exit 1 is a finding: the Job's podFailurePolicy fails it at once (reason
    PodFailurePolicy). A Job that failed otherwise has no verdict (CouldNotRun): its tries
    all could not run (BackoffLimitExceeded), or it ran out of time (DeadlineExceeded: a pod
    stuck Pending on its image, a canary slower than its timeout). A Job from before the
    podFailurePolicy (backoffLimit 0) is judged by its pod's exit code."""
    name = job["metadata"]["name"]
    ids = {"uid": job["metadata"].get("uid"), "rerun": rerun_value(job)}
    conditions = {
        c.get("type"): c
        for c in (job.get("status") or {}).get("conditions") or []
        if c.get("status") == "True"
    }
    tries = sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    message = next((m for pod in reversed(tries) if (m := _termination_message(pod))), "")
    message, implicated = split_implicated(message)
    if "Complete" in conditions:
        return CanaryOutcome(name, JobPhase.SUCCEEDED, message, **ids)
    if "Failed" not in conditions:
        return CanaryOutcome(name, JobPhase.RUNNING, message, **ids)
    failed = conditions["Failed"]
    reason = failed.get("reason") or ""
    findings = [pod for pod in tries if _exit(pod) == EXIT_FINDING]
    if reason == "PodFailurePolicy" or findings:
        if findings:
            message, implicated = split_implicated(_termination_message(findings[-1]))
        why = message or f"job failed: {failed.get('message')}"
        return CanaryOutcome(name, JobPhase.FAILED, why, implicated=implicated, **ids)
    attempts = sum((p.get("status") or {}).get("phase") == "Failed" for p in tries)
    why = {
        "BackoffLimitExceeded": f"no verdict in {attempts} tries",
        "DeadlineExceeded": "the Job ran past its activeDeadlineSeconds (a pod that never "
        "started, e.g. an image that does not pull, or a canary slower than its timeout)",
    }.get(reason, failed.get("message") or "the Job failed")
    last = _last_words(tries[-1]) if tries else ""
    return CanaryOutcome(
        name,
        JobPhase.COULD_NOT_RUN,
        f"could not run ({reason or 'Failed'}): {why}" + (f"; last try: {last}" if last else ""),
        **ids,
    )


# ---- is it the Job the operator built? ----------------------------------------------------------


def job_context_length(job: Mapping[str, Any]) -> int | None:
    """The --context-length a canary Job's container was given (the revision's effective
    context when the Job was built), if it reads as one."""
    containers = _pod_spec(job).get("containers") or []
    args = next((c.get("args") or [] for c in containers if c.get("name") == CANARY_CONTAINER), [])
    for flag, value in itertools.pairwise(args):
        if flag == "--context-length":
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


def job_mismatch(live: Mapping[str, Any], built: Mapping[str, Any]) -> str | None:
    """Why `live` is not the canary Job the operator builds (`built`: build_canary_job for
    the same revision, with the context and rerun value `live` records), or None when it is.
    The compare is drift's (`declared ⊆ live`: fields the API server defaults are not a
    difference; lists element by element, so an added container or env var is one), over the
    whole Job spec, and no init container the operator does not declare. Anyone who may
    create a Job can give it the canary's name, labels and ownerReference: only its spec
    says whether what ran was the canary."""
    built_pod, live_pod = _pod_spec(built), _pod_spec(live)
    (wanted,) = built_pod["containers"]
    container: Mapping[str, Any] = next(
        (c for c in live_pod.get("containers") or [] if c.get("name") == CANARY_CONTAINER), {}
    )
    for field in ("image", "command", "args", "env"):
        if not holds(wanted.get(field), container.get(field)):
            return f"its {CANARY_CONTAINER} container's {field} is not the canary's"
    if live_pod.get("initContainers") and not holds(
        built_pod.get("initContainers"), live_pod["initContainers"]
    ):
        return "it has init containers the canary does not"
    if not holds(built["spec"], live.get("spec")):
        return "its spec is not the canary Job's"
    return None


def _pod_spec(job: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((job.get("spec") or {}).get("template") or {}).get("spec") or {}


def _canary_container(pod: Mapping[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((s for s in statuses if s.get("name") == CANARY_CONTAINER), {})


def _exit(pod: Mapping[str, Any]) -> int | None:
    terminated = (_canary_container(pod).get("state") or {}).get("terminated") or {}
    code = terminated.get("exitCode")
    return int(code) if code is not None else None


def _termination_message(pod: Mapping[str, Any]) -> str:
    terminated = (_canary_container(pod).get("state") or {}).get("terminated") or {}
    return str(terminated.get("message") or "").strip()


def split_implicated(message: str) -> tuple[str, tuple[str, ...]]:
    """A termination message's summary, and the backends its IMPLICATED_BACKENDS line names."""
    summary, implicated = [], []
    for line in message.splitlines():
        if line.startswith(IMPLICATED_BACKENDS):
            implicated += line.removeprefix(IMPLICATED_BACKENDS).split()
        else:
            summary.append(line)
    return "\n".join(summary).strip(), tuple(implicated)


def _last_words(pod: Mapping[str, Any]) -> str:
    """What a try ended with: the canary's summary, else its exit code, else why its container
    is waiting (ImagePullBackOff: ...)."""
    state = _canary_container(pod).get("state") or {}
    if (said := _termination_message(pod)) or "terminated" in state:
        return said or f"exit code {state['terminated'].get('exitCode')}"
    waiting = state.get("waiting") or {}
    return ": ".join(str(w) for w in (waiting.get("reason"), waiting.get("message")) if w)
