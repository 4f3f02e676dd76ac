"""PodDisruptionBudgets: a voluntary disruption (a node drain, a cluster upgrade) takes at
most one pod of each of a revision's roles at a time, so the rest keep serving."""

from typing import Any

from kvfence_operator.crd.types import Role
from kvfence_operator.meta import Instance, child_name, labels, object_meta, selector

BUDGETED_ROLES = (Role.PREFILL, Role.DECODE, Role.ROUTER)
# one pod of each role may be down at a time: also what Ready's "minimum available" allows
# (rollout.RevisionObservation.available)
MAX_UNAVAILABLE = 1


def build_disruption_budgets(instance: Instance, revision: str) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": object_meta(
                instance, child_name(instance, revision, role), labels(instance, revision, role)
            ),
            "spec": {
                "maxUnavailable": MAX_UNAVAILABLE,
                "selector": {"matchLabels": selector(instance, revision, role)},
            },
        }
        for role in BUDGETED_ROLES
    ]
