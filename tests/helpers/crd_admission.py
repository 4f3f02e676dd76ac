"""Sample manifests, and a stand-in for what the API server checks when a user applies an
InferenceDeployment against the generated CRD: the devcluster's own admission
(kvfence_devcluster/admission.py: the OpenAPI schema, unknown fields as with kubectl's default
--validate=strict, and the CEL rules). There is no kube-apiserver on these machines to ask
instead.
"""

import copy
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from kvfence_devcluster.admission import CrdAdmission, Refusal

__all__ = ["CrdAdmission", "Refusal", "crd_admission", "load_sample", "stored_spec"]
from kvfence_operator.crd.schema import build_crd

SAMPLES = Path(__file__).parent / "samples"
SAMPLE_NAMES = sorted(p.stem for p in SAMPLES.glob("*.yaml"))


def load_sample(name: str) -> dict[str, Any]:
    return yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())


def openapi_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@cache
def crd_admission() -> CrdAdmission:
    """One shared instance: compiling the CEL rules is the slow part."""
    return CrdAdmission(openapi_schema(build_crd()))


def stored_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as the API server stores it when it is created: structural defaulting with the
    generated CRD's schema (in every object present, each missing property with a `default`
    gets it; a missing parent stays missing)."""

    def fill(value: Any, schema: dict[str, Any]) -> Any:
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            out = {k: fill(v, props.get(k) or schema.get("additionalProperties") or {})
                   for k, v in value.items()}  # fmt: skip
            for key, prop in props.items():
                if key not in out and "default" in prop:
                    out[key] = fill(copy.deepcopy(prop["default"]), prop)
            return out
        if isinstance(value, list):
            return [fill(v, schema.get("items") or {}) for v in value]
        return value

    return dict(fill(spec, openapi_schema(build_crd())["properties"]["spec"]))
