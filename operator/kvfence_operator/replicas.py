"""Replica counts are revision-neutral: the spec's counts apply to the serving revision as well
as to a candidate, so scaling works while a rollout is stuck (a failed canary, a refused pool)."""

from kvfence_operator.crd.types import InferenceDeploymentSpec, Role


def replica_counts(spec: InferenceDeploymentSpec) -> dict[Role, int]:
    """Each role's Deployment replicas, as the builders write them."""
    return {
        Role.PREFILL: spec.prefill.replicas,
        Role.DECODE: spec.decode.replicas,
        Role.ROUTER: spec.router.replicas,
    }
