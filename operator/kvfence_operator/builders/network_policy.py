"""NetworkPolicies for one revision: only that revision's routers (and the operator, which
reads /v1/kvpool) reach the engines' HTTP port, and only that revision's prefill pods reach
decode's transfer port. The routers' HTTP port is the public endpoint only once the revision
serves (the stable Service selects it); before, only its canary Job and the operator reach it,
so a candidate that has not passed its canary cannot be used with real tenant keys. The
metrics scrapers the platform team names (builders/metrics.py) reach the HTTP port of every
engine and router, where only /metrics answers their token."""

from typing import Any

from kvfence_operator.builders.metrics import NO_METRICS_ACCESS, MetricsAccess
from kvfence_operator.crd.types import Role
from kvfence_operator.meta import (
    HTTP_PORT,
    OPERATOR_POD_LABELS,
    TRANSFER_PORT,
    Instance,
    child_name,
    labels,
    object_meta,
    selector,
)

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace since 1.22


def _peers(instance: Instance, revision: str, role: Role) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": selector(instance, revision, role)}}


def _policy(
    instance: Instance, revision: str, role: Role, ingress: list[dict[str, Any]]
) -> dict[str, Any]:
    name = child_name(instance, revision, role)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(instance, name, labels(instance, revision, role)),
        "spec": {
            "podSelector": {"matchLabels": selector(instance, revision, role)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _operator_peer(operator_namespace: str) -> dict[str, Any]:
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}},
        "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
    }


def _http_rule(instance: Instance, revision: str, operator_namespace: str) -> dict[str, Any]:
    return {
        "from": [_peers(instance, revision, Role.ROUTER), _operator_peer(operator_namespace)],
        "ports": [{"protocol": "TCP", "port": HTTP_PORT}],
    }


def build_router_network_policy(
    instance: Instance,
    revision: str,
    operator_namespace: str,
    serving: bool,
    metrics: MetricsAccess = NO_METRICS_ACCESS,
) -> dict[str, Any]:
    """The routers' policy: while the revision does not serve, its HTTP port admits only the
    revision's canary Job pods and the operator's pods; once it serves, everyone (no `from`).
    Reconciled every pass, so promotion opens it and nothing else does."""
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": HTTP_PORT}]}
    if not serving:
        rule = {
            "from": [_peers(instance, revision, Role.CANARY), _operator_peer(operator_namespace)],
            **rule,
        }
    return _policy(instance, revision, Role.ROUTER, [rule, *metrics.ingress()])


def build_network_policies(
    instance: Instance,
    revision: str,
    operator_namespace: str,
    metrics: MetricsAccess = NO_METRICS_ACCESS,
) -> list[dict[str, Any]]:
    transfer_rule = {
        "from": [_peers(instance, revision, Role.PREFILL)],
        "ports": [{"protocol": "TCP", "port": TRANSFER_PORT}],
    }
    return [
        _policy(
            instance,
            revision,
            Role.PREFILL,
            [_http_rule(instance, revision, operator_namespace), *metrics.ingress()],
        ),
        _policy(
            instance,
            revision,
            Role.DECODE,
            [_http_rule(instance, revision, operator_namespace), transfer_rule, *metrics.ingress()],
        ),
    ]
