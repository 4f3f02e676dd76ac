"""What a kube-apiserver checks when a custom resource is written: its CRD's schema.

Three checks, as the apiextensions server runs them: the OpenAPI schema (jsonschema's Draft 4
validator, whose boolean exclusiveMinimum matches OpenAPI v3.0), unknown fields (an error
under `fieldValidation=Strict`, kubectl's default; the devcluster keeps them otherwise, where a
kube-apiserver prunes them), and the CEL rules (`x-kubernetes-validations`, by cel-python;
skipped when a value has the wrong type, as the API server skips them after such "blocking"
errors). The unit tests use the same checks on manifests (tests/helpers/crd_admission.py).
"""

import json
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema

from .resources import ApiError, ResourceType


@dataclass(frozen=True)
class Refusal:
    check: str  # "openapi", "unknown-field" or "cel"
    path: str  # as Kubernetes writes field paths: spec.prefill.pod.tolerations[0].effect
    message: str


def _field_path(parts: Any) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _quoted(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | int | float | bool) else f"{type(value)}"


class CrdAdmission:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self.openapi = jsonschema.Draft4Validator(schema)
        self.cel = celpy.Environment()
        self.programs: dict[str, Any] = {}

    def refusals(self, obj: dict[str, Any]) -> list[Refusal]:
        schema_errors = list(self.openapi.iter_errors(obj))
        found = [
            Refusal("openapi", _field_path(e.absolute_path), self._openapi_message(e))
            for e in schema_errors
        ]
        if any(e.validator in ("type", "required") for e in schema_errors):
            return found
        # metadata is validated as ObjectMeta by the server, not by the CRD's schema.
        for key in ("spec", "status"):
            if key in obj:
                self._walk(self.schema["properties"][key], obj[key], key, found)
        return found

    @staticmethod
    def _openapi_message(error: jsonschema.ValidationError) -> str:
        """In the API server's words where they differ much from jsonschema's."""
        if error.validator == "enum":
            values: list[Any] = list(error.validator_value)  # type: ignore[arg-type]  # set for enum
            allowed = ", ".join(_quoted(v) for v in values)
            return f"Unsupported value: {_quoted(error.instance)}: supported values: {allowed}"
        if error.validator == "required":
            return f"Required value: {error.message}"
        return f"Invalid value: {_quoted(error.instance)}: {error.message}"

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


def refuse(rt: ResourceType, obj: dict[str, Any], refusals: list[Refusal], strict: bool) -> None:
    """Raise the error a kube-apiserver answers for these refusals, if any counts: 400 for
    unknown fields under strict field validation, else 422 Invalid listing every other."""
    name = (obj.get("metadata") or {}).get("name", "")
    unknown = [r for r in refusals if r.check == "unknown-field"]
    if unknown and strict:
        fields = ", ".join(f'unknown field "{r.path}"' for r in unknown)
        raise ApiError(
            400,
            "BadRequest",
            f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: strict '
            f"decoding error: {fields}",
        )
    causes = [
        {
            "reason": "FieldValueInvalid",
            "field": r.path,
            "message": r.message
            if r.check == "openapi"
            else f'Invalid value: "object": {r.message}',
        }
        for r in refusals
        if r.check != "unknown-field"
    ]
    if causes:
        listed = [f"{c['field']}: {c['message']}" for c in causes]
        why = listed[0] if len(listed) == 1 else f"[{', '.join(listed)}]"
        raise ApiError(
            422,
            "Invalid",
            f'{rt.kind}.{rt.group} "{name}" is invalid: {why}',
            {"name": name, "group": rt.group, "kind": rt.kind, "causes": causes},
        )
