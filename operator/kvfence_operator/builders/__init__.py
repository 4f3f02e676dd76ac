"""What one revision consists of, in the order to create it.

Credentials and configuration come before the pods that mount them, and the NetworkPolicies
before the engines they fence, so an engine never runs unprotected. The canary Job (created once
the revision's pods are Ready) and the stable Service (switched on promotion) are built apart:
`canary_job.build_canary_job`, `router_deployment.build_stable_service`.
"""

from typing import Any

from kvfence_operator.builders.disruption_budget import build_disruption_budgets
from kvfence_operator.builders.engine_deployment import (
    ENGINE_ROLES,
    build_engine_deployment,
    build_engine_service,
)
from kvfence_operator.builders.metrics import NO_METRICS_ACCESS, MetricsAccess
from kvfence_operator.builders.network_policy import (
    build_network_policies,
    build_router_network_policy,
)
from kvfence_operator.builders.router_deployment import (
    build_router_configmap,
    build_router_deployment,
    build_router_service,
)
from kvfence_operator.builders.secret import RevisionCredentials, build_revision_secret
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.meta import ANNOTATION_SPEC, Instance
from kvfence_operator.revision import spec_record


def build_revision_children(
    spec: InferenceDeploymentSpec,
    instance: Instance,
    revision: str,
    credentials: RevisionCredentials,
    operator_namespace: str,
    context_length: int | None = None,
    serving: bool = False,
    metrics: MetricsAccess = NO_METRICS_ACCESS,
    deployments_spec: InferenceDeploymentSpec | None = None,
    credentials_mark: str | None = None,
) -> list[dict[str, Any]]:
    """serving: whether the stable Service selects this revision (its routers are public);
    metrics: how Prometheus reaches the pods (builders/metrics.py); deployments_spec: what the
    Deployments are built from, when not `spec` (its replica counts: decisions/replicas.py);
    credentials_mark: what the router ConfigMap records of the key that derived the
    credentials (secret.derived_mark), None for generated ones."""
    scaled = deployments_spec or spec
    deployments = [
        *(
            build_engine_deployment(scaled, instance, revision, role, metrics)
            for role in ENGINE_ROLES
        ),
        build_router_deployment(scaled, instance, revision, metrics),
    ]
    for deployment in deployments:  # copies of the record: see with_record
        with_record(deployment, spec)
    return [
        build_revision_secret(instance, revision, credentials),
        build_router_configmap(spec, instance, revision, context_length, mark=credentials_mark),
        *build_network_policies(instance, revision, operator_namespace, metrics),
        build_router_network_policy(instance, revision, operator_namespace, serving, metrics),
        *(build_engine_service(instance, revision, role) for role in ENGINE_ROLES),
        build_router_service(instance, revision),
        *build_disruption_budgets(instance, revision),
        *deployments,
    ]


def with_record(deployment: dict[str, Any], spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The revision's spec record (meta.ANNOTATION_SPEC, revision.spec_record) on one of its
    Deployments, beside the one on its router ConfigMap: a copy a pass can judge and declare
    the revision from when another is removed or does not hash to the revision, and puts back
    (a metadata annotation: declared, so drift repair restores it; no pod restarts)."""
    deployment["metadata"].setdefault("annotations", {})[ANNOTATION_SPEC] = spec_record(spec)
    return deployment
