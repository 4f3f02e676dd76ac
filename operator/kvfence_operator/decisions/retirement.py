"""Retirement after a drain, as one pure function.

Promotion switches the stable Service's selector; the revision it stopped selecting keeps its
pods, gates and backends for `spec.rollout.retireAfterSeconds`, so that connections clients
opened to it before the switch (streams, keep-alive) finish there. Only then is it deleted,
and its pods drain once more on their own (preStop, then a graceful stop).

The state is `status.revision.retiring: [{revision, since}]`, so a restarted operator waits
out the same delay. A status lost meanwhile forgets it: the revision is then neither current
nor candidate nor retiring, and the next pass deletes it (a lost status shortens the drain).
"""

from collections.abc import Sequence
from datetime import datetime, timedelta

from kvfence_operator.crd.types import RetiringRevision, RevisionStatus


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
