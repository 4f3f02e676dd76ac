"""Replica counts are revision-neutral: the spec's counts apply to every kept revision, the
serving one as well as a candidate, so scaling works while a rollout is stuck (a failed canary,
a refused pool), and a child Deployment scaled by hand is set back."""

from kvfence_operator.crd.types import InferenceDeploymentSpec


def with_replicas_of(
    spec: InferenceDeploymentSpec, counts: InferenceDeploymentSpec
) -> InferenceDeploymentSpec:
    """`spec` (the one a revision's children are declared from) with the replica counts of
    `counts` (the object's spec): what the revision's Deployments are built from."""
    return spec.model_copy(
        update={
            "prefill": spec.prefill.model_copy(update={"replicas": counts.prefill.replicas}),
            "decode": spec.decode.model_copy(update={"replicas": counts.decode.replicas}),
            "router": spec.router.model_copy(update={"replicas": counts.router.replicas}),
        }
    )
