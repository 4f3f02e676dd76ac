"""Specs and the instance the builder tests build for."""

from typing import Any

from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.canary_job import build_canary_job
from kvfence_operator.builders.router_deployment import build_stable_service
from kvfence_operator.builders.secret import RevisionCredentials
from kvfence_operator.crd.types import InferenceDeployment, InferenceDeploymentSpec
from kvfence_operator.meta import Instance
from kvfence_operator.revision import revision_of

from .crd_admission import load_sample

OPERATOR_NAMESPACE = "kvfence-system"
CREDENTIALS = RevisionCredentials(
    internal_token="internal-token-" + "t" * 32,
    tenant_a_key="tenant-a-key-" + "a" * 32,
    tenant_b_key="tenant-b-key-" + "b" * 32,
)


def sample_spec(name: str) -> InferenceDeploymentSpec:
    return InferenceDeployment.model_validate(load_sample(name)).spec


def instance_for(name: str) -> Instance:
    manifest = load_sample(name)["metadata"]
    return Instance(
        name=manifest["name"],
        namespace=manifest.get("namespace", "default"),
        uid=f"uid-of-{manifest['name']}",
    )


def everything_built(name: str) -> list[dict[str, Any]]:
    """Every object the operator creates for one sample at its current revision."""
    spec, instance = sample_spec(name), instance_for(name)
    revision = revision_of(spec)
    return [
        *build_revision_children(spec, instance, revision, CREDENTIALS, OPERATOR_NAMESPACE),
        build_canary_job(spec, instance, revision),
        build_stable_service(spec, instance, revision),
    ]


def pod_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["template"]["spec"]


def container(manifest: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec(manifest)["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    """The value argparse keeps: the last occurrence wins."""
    positions = [i for i, a in enumerate(args) if a == name]
    assert positions, f"{name} missing from {args}"
    return args[positions[-1] + 1]
