"""Running a revision's canary again, on request.

A canary that failed or could not run stops the rollout until the spec changes. When the cause
was outside the revision (a node, the network, an image registry) the user asks for a new run
by giving the InferenceDeployment's `kvfence.dev/rerun-canary` annotation a new value. The
canary Job records the value it was created with; when the two differ, the operator deletes
the candidate's Job (its pods with it) and starts a fresh one. Only a candidate's canary is
re-run: the serving revision's passed canary never is.
"""

from collections.abc import Mapping
from typing import Any

ANNOTATION_RERUN_CANARY = "kvfence.dev/rerun-canary"


def rerun_value(obj: Mapping[str, Any] | None) -> str:
    """The annotation's value on an InferenceDeployment or a canary Job; "" when absent (so a
    Job created before the annotation existed, or while it was unset, matches no value)."""
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(ANNOTATION_RERUN_CANARY) or "")


def rerun_requested(job: Mapping[str, Any], wanted: str) -> bool:
    """Did the user ask for a new run since `job` was created? `wanted`: the
    InferenceDeployment's value."""
    return rerun_value(job) != wanted
