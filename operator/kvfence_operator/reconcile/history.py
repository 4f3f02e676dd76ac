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


@dataclass
class ScalingHistory:
    _by_uid: dict[str, dict[Role, list[Recommendation]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def of(self, uid: str) -> dict[Role, tuple[Recommendation, ...]]:
        with self._lock:
            return {role: tuple(recs) for role, recs in self._by_uid.get(uid, {}).items()}

    def record(self, uid: str, recommendations: Mapping[Role, Recommendation]) -> None:
        with self._lock:
            roles = self._by_uid.setdefault(uid, {})
            for role, recommendation in recommendations.items():
                kept = [r for r in roles.get(role, []) if recommendation.at - r.at <= KEEP_SECONDS]
                roles[role] = [*kept, recommendation]

    def forget(self, uid: str) -> None:
        with self._lock:
            self._by_uid.pop(uid, None)
