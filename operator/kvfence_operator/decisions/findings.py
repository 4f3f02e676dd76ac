"""What a pass meets besides the cluster's state, for Degraded and Events: errors the API
answered, names someone else holds, a spec that does not validate, credentials it may not read.

`Findings` is a value of one pass, handed to what may add to it: kopf runs the timers of
different InferenceDeployments at once on the one Reconciler, so nothing of a pass lives on it.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfence_operator.crd.types import ConditionReason
from kvfence_operator.decisions.pods import engine_failure
from kvfence_operator.meta import LABEL_REVISION, owner_description


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


@dataclass(frozen=True, slots=True)
class Problem:
    """An error the operator met this pass, for Degraded and an Event."""

    reason: ConditionReason
    message: str


@dataclass(frozen=True, slots=True)
class Conflict:
    """A name the operator needs that an object it does not control already has."""

    kind: str
    name: str
    owner: str  # owner_description of the existing object
    # why an object this InferenceDeployment controls is still not the operator's (a canary
    # Job someone else made with its ownerReference); "": it is not controlled by it
    not_built: str = ""

    @classmethod
    def of(cls, existing: Mapping[str, Any], not_built: str = "") -> "Conflict":
        name = existing["metadata"]["name"]
        return cls(existing["kind"], name, owner_description(existing), not_built)

    @property
    def message(self) -> str:
        if self.not_built:
            return (
                f"{self.kind} {self.name} is not the one the operator built ({self.not_built}), "
                "though it names this InferenceDeployment as its controller; it is left "
                "untouched and has no verdict: delete it, or give kvfence.dev/rerun-canary a "
                "new value"
            )
        return (
            f"{self.kind} {self.name} exists and is not controlled by this "
            f"InferenceDeployment (its controller: {self.owner}); it is left untouched: "
            "rename or delete it"
        )


@dataclass(slots=True)
class Findings:
    """One pass's: names taken by objects this InferenceDeployment does not control, and
    errors the API answered."""

    conflicts: list[Conflict] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def unique_conflicts(self) -> list[Conflict]:
        return list(dict.fromkeys(self.conflicts))


def create_problem(kind: str, name: str, status: int, message: str) -> Problem:
    """The API refused to create a child: `status` and the API server's own `message`."""
    reason = ConditionReason.CREATE_REJECTED if status == 422 else ConditionReason.CREATE_FAILED
    return Problem(reason, f"cannot create {kind} {name} ({status}): {message}")


def keys_secret_problem(name: str, namespace: str) -> Problem:
    return Problem(
        ConditionReason.API_KEYS_SECRET_MISSING,
        f"Secret {name} (spec.router.apiKeysSecret) does not exist in namespace {namespace}: "
        "the routers cannot start until it does",
    )


def summary(problems: Sequence[Problem]) -> tuple[ConditionReason, str] | None:
    """Degraded's (reason, message) for this pass's problems: the first one's reason."""
    if not problems:
        return None
    return problems[0].reason, "; ".join(dict.fromkeys(p.message for p in problems))


def record_refused(revision: str, refused: Sequence[str]) -> Problem:
    """A revision other than the spec's with no record of its spec that hashes to it: it is
    neither judged nor declared by any spec (the object's would be the candidate's)."""
    where = f" (refused on {', '.join(refused)})" if refused else ""
    return Problem(
        ConditionReason.REVISION_RECORD_REFUSED,
        f"revision {revision} has no record of its spec that hashes to it{where}: its "
        f"children, gates and backends are left as they are, neither judged nor put back by "
        "another revision's spec. Restore its kvfence.dev/spec annotation, or roll out a new "
        "revision",
    )


def engine_crash_loop(revision: str, pods: Sequence[Mapping[str, Any]]) -> Problem | None:
    """A revision's engine pods whose container exited with an error and has not been ready
    since (pods.engine_failure), as one problem: each distinct failure once, in the engine's
    own words. Nothing that changes while the pods keep failing the same way (no restart
    count, no pod names: the second pod to fail would change the words), so Degraded's message
    and its one Event hold across restarts and as more pods of the revision fail alike."""
    failures = [failure for pod in pods if (failure := engine_failure(pod)) is not None]
    if not failures:
        return None
    said = "; ".join(
        dict.fromkeys(f"exited {failure.exit_code}: {failure.reason}" for failure in failures)
    )
    return Problem(
        ConditionReason.ENGINE_CRASH_LOOPING,
        f"revision {revision}: its engine pods crash-loop (not ready since they failed; "
        f"kubectl get pods -l {LABEL_REVISION}={revision}): {said}",
    )
