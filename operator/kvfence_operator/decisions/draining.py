"""A scale-down that drops no stream: the pods a lower count removes are chosen (the idlest),
taken out of the routers' backends first, and their Deployment's replicas are lowered only once
each has finished what it was serving. Pure; the pass reads the pods and writes the marks.

- A pod is marked draining (meta.ANNOTATION_DRAINING, when; and the lowest
  pod-deletion-cost, so its ReplicaSet removes it and no serving pod). A marked pod is in no
  router's backends file from the pass that marks it on.
- It has finished once a load report read after the routers were given the backends without
  it (SETTLE_SECONDS after the mark) shows nothing running or waiting, or once it has drained
  for the pods' termination grace period (its engine's own drain then finishes what is left,
  as for any stopping pod).
- The replicas are lowered when every pod marked has finished. Pods that do not serve (still
  starting, refused by the pool gate) need no drain: the ReplicaSet removes a pod that is not
  Ready before any Ready one, so they are counted first, as are replicas it has not created
  (a count raised by hand: no pod to drain).
- A count that goes back up before that unmarks them: they serve again.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvfence_operator.decisions.autoscaling import PodLoad

SETTLE_SECONDS = 2.0  # after the mark: the routers have the backends file without the pod
DRAINED_DELETION_COST = "-1000"


@dataclass(frozen=True, slots=True)
class RolePod:
    """One engine pod of the role, as the pass saw it."""

    name: str
    serving: bool  # its kv-pool gate is True
    draining_since: float | None  # time.time() it was marked; None: not marked
    load: PodLoad | None
    created: float  # time.time() of its creationTimestamp

    def finished(self, now: float, grace_seconds: float) -> bool:
        since = self.draining_since
        if since is None:
            return False
        if not self.serving or now - since >= grace_seconds:
            return True
        load = self.load
        return (
            load is not None
            and load.read_at >= since + SETTLE_SECONDS
            and load.fresh(now) is not None
            and not load.busy
        )

    def in_flight(self, now: float) -> int:
        """What it serves now (unknown: as much as can be)."""
        report = self.load.fresh(now) if self.load is not None else None
        if report is None:
            return 1 << 30
        return report.running_sequences + report.waiting_requests


@dataclass(frozen=True, slots=True)
class DrainPlan:
    replicas: int  # the role's Deployment's, this pass
    mark: tuple[str, ...] = ()  # to mark draining now
    unmark: tuple[str, ...] = ()  # marked, and serving again
    waiting_for: tuple[str, ...] = ()  # marked, still finishing what they serve

    def draining(self, pods: Sequence[RolePod]) -> frozenset[str]:
        """The pods out of the routers' backends after this pass."""
        marked = {p.name for p in pods if p.draining_since is not None}
        return frozenset((marked | set(self.mark)) - set(self.unmark))


def plan_drain(
    replicas: int, desired: int, pods: Sequence[RolePod], now: float, grace_seconds: float
) -> DrainPlan:
    """From the Deployment's `replicas` towards `desired` without dropping a stream."""
    marked = sorted((p for p in pods if p.draining_since is not None), key=_since)
    if desired >= replicas:
        return DrainPlan(desired, unmark=tuple(p.name for p in marked))
    # not serving, or not even created yet: removed first, and nothing to drain
    starting = sum(1 for p in pods if not p.serving and p.draining_since is None)
    starting += max(0, replicas - len(pods))
    need = max(0, replicas - desired - starting)
    kept, unmark = marked[:need], marked[need:]
    idlest = sorted(
        (p for p in pods if p.serving and p.draining_since is None),
        key=lambda p: (p.in_flight(now), -p.created),
    )
    mark = idlest[: need - len(kept)]
    waiting = [p for p in kept if not p.finished(now, grace_seconds)]
    done = not mark and not waiting
    return DrainPlan(
        desired if done else replicas,
        tuple(p.name for p in mark),
        tuple(p.name for p in unmark),
        tuple(p.name for p in [*waiting, *mark]),
    )


def _since(pod: RolePod) -> float:
    return pod.draining_since or 0.0
