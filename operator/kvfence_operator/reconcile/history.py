"""The autoscaler's memory: each InferenceDeployment's recent recommendations per role, which
stabilization reads (decisions/autoscaling.py). In memory, as Kubernetes' HPA keeps its own: a
new operator (a restart, a leader handover) starts empty, and then scales nothing down until
its recommendations cover the scale-down window again."""

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvfence_operator.crd.types import Role
from kvfence_operator.decisions.autoscaling import Recommendation

KEEP_SECONDS = 3600.0  # the longest stabilization window the CRD allows
PRUNE_EVERY_SECONDS = 60.0


@dataclass
class ScalingHistory:
    _by_uid: dict[str, dict[Role, list[Recommendation]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pruned_at: float = float("-inf")

    def of(self, uid: str) -> dict[Role, tuple[Recommendation, ...]]:
        with self._lock:
            return {role: tuple(recs) for role, recs in self._by_uid.get(uid, {}).items()}

    def record(self, uid: str, recommendations: Mapping[Role, Recommendation]) -> None:
        """Keep this pass's recommendations, and forget what is older than any window (an
        InferenceDeployment deleted, or no longer scaled, is forgotten with it)."""
        if not recommendations:
            return
        now = max(r.at for r in recommendations.values())
        with self._lock:
            if now - self._pruned_at >= PRUNE_EVERY_SECONDS:  # every object's, now and then
                self._pruned_at = now
                for roles in self._by_uid.values():
                    for role, recs in list(roles.items()):
                        roles[role] = [r for r in recs if now - r.at <= KEEP_SECONDS]
                self._by_uid = {u: r for u, r in self._by_uid.items() if any(r.values())}
            roles = self._by_uid.setdefault(uid, {})
            for role, recommendation in recommendations.items():
                kept = [r for r in roles.get(role, []) if now - r.at <= KEEP_SECONDS]
                roles[role] = [*kept, recommendation]
