"""The typed core/v1 shapes (kvfence_operator/crd/core_v1.py) are subsets of Kubernetes' own:
every field they have is a field of the Kubernetes type with the same JSON type, their enums are
values Kubernetes takes, and every field Kubernetes requires they require too."""

import json
from pathlib import Path

import kubernetes_validate
import pytest
from pydantic import BaseModel

from helpers.builders import instance_for, sample_spec
from kvfence_operator.builders.engine_deployment import build_engine_deployment
from kvfence_operator.crd import core_v1
from kvfence_operator.crd.schema import structural
from kvfence_operator.crd.types import Role

DEFINITIONS = json.loads(
    (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema/v1.32.0-local-strict/_definitions.json"
    ).read_text()
)["$defs"]
CORE = "io.k8s.api.core.v1."
META = "io.k8s.apimachinery.pkg.apis.meta.v1."

SHAPES: list[tuple[type[BaseModel], str]] = [
    (core_v1.Toleration, CORE + "Toleration"),
    (core_v1.Affinity, CORE + "Affinity"),
    (core_v1.NodeAffinity, CORE + "NodeAffinity"),
    (core_v1.NodeSelector, CORE + "NodeSelector"),
    (core_v1.NodeSelectorTerm, CORE + "NodeSelectorTerm"),
    (core_v1.NodeSelectorRequirement, CORE + "NodeSelectorRequirement"),
    (core_v1.PreferredSchedulingTerm, CORE + "PreferredSchedulingTerm"),
    (core_v1.PodAffinity, CORE + "PodAffinity"),
    (core_v1.PodAffinity, CORE + "PodAntiAffinity"),
    (core_v1.PodAffinityTerm, CORE + "PodAffinityTerm"),
    (core_v1.WeightedPodAffinityTerm, CORE + "WeightedPodAffinityTerm"),
    (core_v1.LabelSelector, META + "LabelSelector"),
    (core_v1.LabelSelectorRequirement, META + "LabelSelectorRequirement"),
    (core_v1.TopologySpreadConstraint, CORE + "TopologySpreadConstraint"),
    (core_v1.EnvVarSource, CORE + "EnvVarSource"),
    (core_v1.KeySelector, CORE + "SecretKeySelector"),
    (core_v1.KeySelector, CORE + "ConfigMapKeySelector"),
    (core_v1.ObjectFieldSelector, CORE + "ObjectFieldSelector"),
    (core_v1.ResourceFieldSelector, CORE + "ResourceFieldSelector"),
    (core_v1.PersistentVolumeClaimVolumeSource, CORE + "PersistentVolumeClaimVolumeSource"),
    (core_v1.ImageVolumeSource, CORE + "ImageVolumeSource"),
    (core_v1.CSIVolumeSource, CORE + "CSIVolumeSource"),
    (core_v1.NFSVolumeSource, CORE + "NFSVolumeSource"),
    (core_v1.LocalObjectReference, CORE + "LocalObjectReference"),
]


def _json_type(node: dict) -> str | None:
    if "$ref" in node:
        target = DEFINITIONS[node["$ref"].rsplit("/", 1)[-1]]
        if target.get("format") == "int-or-string" or "oneOf" in target:
            return "int-or-string"
        return _json_type(target)
    if node.get("x-kubernetes-int-or-string") or node.get("format") == "int-or-string":
        return "int-or-string"
    types = node.get("type")
    if isinstance(types, list):
        types = next(t for t in types if t != "null")
    return types


@pytest.mark.parametrize(("model", "definition"), SHAPES, ids=[d for _, d in SHAPES])
def test_typed_shape_is_a_subset_of_the_kubernetes_type(model, definition):
    schema = model.model_json_schema(by_alias=True)
    ours = structural(schema, schema.pop("$defs", {}))
    theirs = DEFINITIONS[definition]
    for name, prop in ours["properties"].items():
        assert name in theirs["properties"], f"{definition} has no field {name}"
        want = _json_type(theirs["properties"][name])
        got = "int-or-string" if prop.get("x-kubernetes-int-or-string") else prop["type"]
        assert got == want, f"{definition}.{name}: {got}, Kubernetes says {want}"
        if "enum" in prop and "enum" in theirs["properties"][name]:
            assert set(prop["enum"]) <= set(theirs["properties"][name]["enum"]) - {None}
    assert set(theirs.get("required", [])) <= set(ours.get("required", [])), definition


def test_typed_overrides_make_a_deployment_kubernetes_accepts():
    deployment = build_engine_deployment(
        sample_spec("full"), instance_for("full"), "abc123", Role.PREFILL
    )
    pod = deployment["spec"]["template"]["spec"]
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["volumes"][-1] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    }
    kubernetes_validate.validate(deployment, "1.32", strict=True)
