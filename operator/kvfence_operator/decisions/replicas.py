"""Replica counts are revision-neutral: the object's counts (the spec's, or the autoscaler's:
decisions/scaling.py) apply to every kept revision, the serving one as well as a candidate, so
scaling works while a rollout is stuck (a failed canary, a refused pool), and a child
Deployment scaled by hand is set back."""

from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.decisions.scaling import Counts


def with_replicas_of(
    spec: InferenceDeploymentSpec,
    counts: InferenceDeploymentSpec,
    engines: Counts | None = None,
) -> InferenceDeploymentSpec:
    """`spec` (the one a revision's children are declared from) with the replica counts of
    `counts` (the object's spec), the engine roles' from `engines` where it gives one: what
    the revision's Deployments are built from."""
    prefill, decode = counts.prefill.replicas, counts.decode.replicas
    if engines is not None:
        prefill = engines.prefill if engines.prefill is not None else prefill
        decode = engines.decode if engines.decode is not None else decode
    return spec.model_copy(
        update={
            "prefill": spec.prefill.model_copy(update={"replicas": prefill}),
            "decode": spec.decode.model_copy(update={"replicas": decode}),
            "router": spec.router.model_copy(update={"replicas": counts.router.replicas}),
        }
    )
