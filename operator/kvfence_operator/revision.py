"""The revision: a short, stable hash of the spec parts that change pods, as the object holds
them; and the spec each revision is judged by, recorded on the revision's own objects.

A new revision means new prefill, decode and router Deployments and a canary before promotion;
changing anything else (replica counts, minContextLength, the Service, canary settings) is
applied in place to the current revision.

What is hashed is the spec as stored (`stored_spec`): the fields the object holds plus the CRD
schema's defaults, which the API server writes into the object when it is created (object
fields default to `{}` so that their fields' defaults apply too: crd/types.py::OBJECT_DEFAULT).
A default is frozen in the object at its creation and the code's defaults are never read, so
an operator release that changes a default rolls nothing.
"""

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kvfence_operator.crd.schema import spec_schema
from kvfence_operator.crd.types import InferenceDeploymentSpec

REVISION_LENGTH = 10


def with_schema_defaults(value: Any, schema: Mapping[str, Any]) -> Any:
    """Kubernetes' structural defaulting: in every object that is present, a property the
    schema gives a `default` and the object lacks gets it (a missing parent stays missing)."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        filled = {k: with_schema_defaults(v, properties.get(k) or {}) for k, v in value.items()}
        for key, prop in properties.items():
            if key not in filled and "default" in prop:
                filled[key] = with_schema_defaults(prop["default"], prop)
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            filled = {
                k: v if k in properties else with_schema_defaults(v, extra)
                for k, v in filled.items()
            }
        return filled
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [with_schema_defaults(v, schema["items"]) for v in value]
    return value


def stored_spec(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The spec as the API server stores it: what was written (the fields the model was
    validated from, nulls dropped) with the CRD schema's defaults filled in. On a cluster the
    object already holds those defaults; from a manifest file (`kvfence up`, tests, the
    devcluster, which does not default) they are added here, so both hash the same."""
    written = spec.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)
    return dict(with_schema_defaults(written, spec_schema()))


def _pruned(value: Any) -> Any:
    """Absent, null, {} and [] mean the same (every list's and map's default is empty): drop
    the latter three, at every level."""
    if isinstance(value, dict):
        kept = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


# spec.rollout.terminationGracePeriodSeconds came with this default. An object stored before
# then gets it from the CRD schema when the operator is upgraded; hashed as absent, it keeps
# its revision (an upgrade rolls nothing). A frozen number, not the code's default.
GRACE_WHEN_INTRODUCED = 300


def _grace_hashed(stored: Mapping[str, Any]) -> int | None:
    grace = (stored.get("rollout") or {}).get("terminationGracePeriodSeconds")
    return None if grace == GRACE_WHEN_INTRODUCED else grace


# Fields of spec.engine that came later, with the default each came with: at that value,
# hashed as absent, as the grace period above.
ENGINE_FIELDS_WHEN_INTRODUCED: dict[str, object] = {
    "prefixCache": {"enabled": False},
    "tensorParallelSize": 1,
}


def _engine_hashed(stored: Mapping[str, Any]) -> Any:
    engine = stored.get("engine")
    if not isinstance(engine, Mapping):
        return engine
    return {
        k: v
        for k, v in engine.items()
        if k not in ENGINE_FIELDS_WHEN_INTRODUCED or v != ENGINE_FIELDS_WHEN_INTRODUCED[k]
    }


def pod_shaping_parts(spec: InferenceDeploymentSpec) -> dict[str, object]:
    stored = stored_spec(spec)

    def without_replicas(role: str) -> dict[str, Any]:
        return {k: v for k, v in (stored.get(role) or {}).items() if k != "replicas"}

    return dict(
        _pruned(
            {
                "model": stored["model"],
                "engine": _engine_hashed(stored),
                "contextLength": stored["contextLength"],
                "poolPolicy": stored.get("poolPolicy"),
                "prefill": without_replicas("prefill"),
                "decode": without_replicas("decode"),
                "router": {
                    "apiKeysSecret": stored["router"]["apiKeysSecret"],
                    "pod": stored["router"].get("pod"),  # pruned when empty: no new revision
                },
                # the router's and the engines' flags
                "tenantLimits": stored.get("tenantLimits"),
                # the pods' grace period and --drain-seconds (retireAfterSeconds is not: it
                # is the operator's timing, applied in place)
                "rollout": {"terminationGracePeriodSeconds": _grace_hashed(stored)},
            }
        )
    )


def revision_of(spec: InferenceDeploymentSpec) -> str:
    """The revision of a spec validated from an object or a manifest (its set fields are what
    is hashed, so build specs with model_validate, not by filling fields in code)."""
    canonical = json.dumps(pod_shaping_parts(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]


# ---- the spec a revision is judged by ----------------------------------------------------------


def spec_record(spec: InferenceDeploymentSpec) -> str:
    """What the kvfence.dev/spec annotation on a revision's router ConfigMap holds: the whole
    spec the revision was last desired under, as the operator read it (defaults filled)."""
    dump = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    return json.dumps(dump, sort_keys=True, separators=(",", ":"))


def recorded_spec(revision: str, record: str | None) -> InferenceDeploymentSpec | None:
    """The spec a record (spec_record) holds, if it is `revision`'s: one that does not parse,
    or whose spec does not hash to `revision`, is refused (None). Anyone who may edit the
    object can write a record; only one that hashes to the revision can be trusted to be its
    spec, since the revision is that hash."""
    if record is None:
        return None
    try:
        recorded = InferenceDeploymentSpec.model_validate(json.loads(record))
    except (ValueError, ValidationError):
        return None
    return recorded if revision_of(recorded) == revision else None


def judged_spec(
    revision: str, desired: str, spec: InferenceDeploymentSpec, record: str | None
) -> InferenceDeploymentSpec | None:
    """The spec a revision's pools, gates, backends file and children are computed from. The
    desired revision: the object's spec (same pod-shaping parts by the hash; in-place changes
    such as minContextLength apply). Any other revision (the one still serving during a
    rollout): the spec recorded on its objects, so a new spec never changes what it serves.
    None when it has no record that hashes to it (recorded_spec): never the object's spec,
    which would judge and declare the serving revision by the candidate's."""
    if revision == desired:
        return spec
    return recorded_spec(revision, record)
