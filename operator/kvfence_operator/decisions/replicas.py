"""Replica counts are revision-neutral: the spec's counts apply to every kept revision, the
serving one as well as a candidate, so scaling works while a rollout is stuck (a failed canary,
a refused pool), and a child Deployment scaled by hand is set back."""

from collections.abc import Mapping
from typing import Any

from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import LABEL_ROLE


def replica_counts(spec: InferenceDeploymentSpec) -> dict[str, int]:
    """Each role's Deployment replicas, as the builders write them, by role name."""
    return {
        str(Role.PREFILL): spec.prefill.replicas,
        str(Role.DECODE): spec.decode.replicas,
        str(Role.ROUTER): spec.router.replicas,
    }


def with_replicas(child: Mapping[str, Any], replicas: Mapping[str, int]) -> dict[str, Any]:
    """A Deployment with its role's count from `replicas`; any other child as it is."""
    role = (child["metadata"].get("labels") or {}).get(LABEL_ROLE)
    if child["kind"] != "Deployment" or role is None or role not in replicas:
        return dict(child)
    return {**child, "spec": {**child["spec"], "replicas": replicas[role]}}
