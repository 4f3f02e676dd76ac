"""Sample manifests, and a stand-in for what the API server checks when a user applies an
InferenceDeployment against the generated CRD.

The stand-in runs the three checks the API server runs: the OpenAPI schema (jsonschema's
Draft 4 validator, whose boolean exclusiveMinimum matches OpenAPI v3.0), strict field
validation (unknown fields are errors, as with kubectl's default --validate=strict), and the
CEL rules (cel-python; skipped when a value has the wrong type, as the API server skips them
after such "blocking" errors). There is no kube-apiserver on these machines to ask instead.
"""

import copy
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

from kvfence_operator.crd.schema import build_crd

SAMPLES = Path(__file__).parent / "samples"
SAMPLE_NAMES = sorted(p.stem for p in SAMPLES.glob("*.yaml"))


def load_sample(name: str) -> dict[str, Any]:
    return yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())


@dataclass(frozen=True)
class Refusal:
    check: str  # "openapi", "unknown-field" or "cel"
    path: str
    message: str


class CrdAdmission:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self.openapi = jsonschema.Draft4Validator(schema)
        self.cel = celpy.Environment()
        self.programs: dict[str, Any] = {}

    def refusals(self, obj: dict[str, Any]) -> list[Refusal]:
        schema_errors = list(self.openapi.iter_errors(obj))
        found = [
            Refusal("openapi", ".".join(map(str, e.absolute_path)), e.message)
            for e in schema_errors
        ]
        if any(e.validator in ("type", "required") for e in schema_errors):
            return found
        # metadata is validated as ObjectMeta by the server, not by the CRD's schema.
        for key in ("spec", "status"):
            if key in obj:
                self._walk(self.schema["properties"][key], obj[key], key, found)
        return found

    def _rule_holds(self, rule: str, value: Any) -> bool:
        if rule not in self.programs:
            self.programs[rule] = self.cel.program(self.cel.compile(rule))
        result = self.programs[rule].evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception):
            raise AssertionError(f"CEL rule {rule!r} failed to evaluate: {result}")
        return bool(result)

    def _walk(self, schema: dict[str, Any], value: Any, path: str, found: list[Refusal]) -> None:
        if value is None:
            return
        for rule in schema.get("x-kubernetes-validations", []):
            if not self._rule_holds(rule["rule"], value):
                found.append(Refusal("cel", path, rule["message"]))
        if isinstance(value, dict):
            properties = schema.get("properties")
            if properties is not None:
                if not schema.get("x-kubernetes-preserve-unknown-fields"):
                    for unknown in sorted(value.keys() - properties.keys()):
                        found.append(Refusal("unknown-field", f"{path}.{unknown}", "unknown field"))
                for key, sub in properties.items():
                    if key in value:
                        self._walk(sub, value[key], f"{path}.{key}", found)
            elif isinstance(schema.get("additionalProperties"), dict):
                for key, item in value.items():
                    self._walk(schema["additionalProperties"], item, f"{path}.{key}", found)
        elif isinstance(value, list) and "items" in schema:
            for index, item in enumerate(value):
                self._walk(schema["items"], item, f"{path}[{index}]", found)


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
