"""Retirement after a drain, as one pure function.

Promotion switches the stable Service's selector; the revision it stopped selecting keeps its
pods, gates and backends for `spec.rollout.retireAfterSeconds`, so that connections clients
opened to it before the switch (streams, keep-alive) finish there. Only then is it deleted,
and its pods drain once more on their own (preStop, then a graceful stop).

The state is `status.revision.retiring: [{revision, since}]`, so a restarted operator waits
out the same delay. A status lost meanwhile forgets it: the revision is then neither current
nor candidate nor retiring, and the next pass deletes it (a lost status shortens the drain).
"""

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from kvfence_operator.builders.secret import CREDENTIALS_MARK
from kvfence_operator.crd.types import RetiringRevision, RevisionStatus
from kvfence_operator.meta import LABEL_REVISION, controlled_by


def drain(
    previous: RevisionStatus | None,
    planned: RevisionStatus,
    *,
    now: datetime | None,
    retire_after_seconds: int,
) -> tuple[Sequence[RetiringRevision], Sequence[RetiringRevision]]:
    """(still draining, drained): the revisions kept after this pass, and those whose delay
    has just passed (deleted now). `previous`: the revision status the pass started from;
    `planned`: the one the rollout plan decided. A revision the plan serves or rolls out
    again (a spec reverted during the drain) is no longer retiring: it is current or
    candidate."""
    retiring = list((previous.retiring if previous is not None else None) or [])
    replaced = previous.current if previous is not None else None
    if replaced is not None and replaced != planned.current and retire_after_seconds > 0:
        assert now is not None, "a drain needs the time of the promotion"
        retiring.append(RetiringRevision(revision=replaced, since=now))
    active = {planned.current, planned.candidate}
    draining: list[RetiringRevision] = []
    drained: list[RetiringRevision] = []
    for entry in retiring:
        if entry.revision in active or any(d.revision == entry.revision for d in draining):
            continue
        if now is not None and now - entry.since < timedelta(seconds=retire_after_seconds):
            draining.append(entry)
        else:
            drained.append(entry)
    return draining, drained


# The kinds a revision owns that the operator may list. Secrets are deleted by name: the
# operator has no list/watch on Secrets (least privilege), so they are found from the others.
REVISION_KINDS = (
    ("apps/v1", "Deployment"),
    ("batch/v1", "Job"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("policy/v1", "PodDisruptionBudget"),
)


@dataclass(frozen=True, slots=True)
class Retirement:
    """What goes of the revisions a pass no longer keeps: their children, in REVISION_KINDS
    order, and their Secrets by name (`derived`: made, never read, by this operator's key,
    so deleted by name; `unread`: an older operator's, deleted only once read to be ours)."""

    children: tuple[tuple[str, str, str], ...] = ()  # (apiVersion, kind, name)
    derived: frozenset[str] = frozenset()  # revisions
    unread: frozenset[str] = frozenset()

    @property
    def revisions(self) -> frozenset[str]:
        return self.derived | self.unread


def retirement(
    children: Mapping[tuple[str, str], Sequence[Mapping[str, Any]]],
    keep: Set[str],
    uid: str,
    credentials_mark: str | None,
) -> Retirement:
    """`children`: the objects labelled as this InferenceDeployment's children, by
    (apiVersion, kind). One it does not control (labelled like ours, someone else's) is never
    deleted; a child without a revision label is none of a revision's."""
    gone: list[tuple[str, str, str]] = []
    retired: dict[str, bool] = {}  # revision -> its credentials were derived
    for api_version, kind in REVISION_KINDS:
        for obj in children.get((api_version, kind), ()):
            if not controlled_by(obj, uid):
                continue
            revision = (obj["metadata"].get("labels") or {}).get(LABEL_REVISION)
            if revision is None or revision in keep:
                continue
            annotations = obj["metadata"].get("annotations") or {}
            derived = credentials_mark is not None and (
                annotations.get(CREDENTIALS_MARK) == credentials_mark
            )
            retired[revision] = retired.get(revision, False) or derived
            gone.append((api_version, kind, obj["metadata"]["name"]))
    return Retirement(
        tuple(gone),
        frozenset(r for r, d in retired.items() if d),
        frozenset(r for r, d in retired.items() if not d),
    )
