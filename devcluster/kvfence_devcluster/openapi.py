"""The OpenAPI v3 documents kubectl reads before it writes.

`kubectl apply`, `create` and `replace` first ask `/openapi/v3` whether the server validates
fields itself (a PATCH operation of the kind that takes the `fieldValidation` query
parameter); without an answer they fail ("failed to download openapi") unless run with
`--validate=false`. Each group-version's document here holds one PATCH operation per kind,
saying so; the request's `fieldValidation` then decides whether an unknown field in a custom
resource is an error (`Strict`, kubectl's default) or kept (admission.py).
The documents carry the schemas of custom resources (their CRD's openAPIV3Schema, so
`kubectl explain infd.spec` works) and none of the built-in kinds (client-side apply then uses
the strategic-merge rules compiled into kubectl; explain says the kind is not found). No path
advertises strategic merge, so kubectl sends custom resources JSON merge patches, as it must.
"""

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from .discovery import Entry

PARAMETER = {
    "name": "fieldValidation",
    "in": "query",
    "description": "Strict: unknown fields of a custom resource are errors; else they are kept",
    "schema": {"type": "string", "uniqueItems": True},
}


def _prefix(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _group_versions(entries: Iterable[Entry]) -> set[tuple[str, str]]:
    return {(r.group or "", r.version) for r, _, _ in entries if r.version and r.plural}


Schemas = Mapping[tuple[str, str, str], dict[str, Any]]  # (group, version, plural) -> schema


def _schema_name(group: str, version: str, kind: str) -> str:
    """As Kubernetes names a CRD's schema: the group reversed (`dev.kvfence.v1alpha1.X`)."""
    return ".".join([*reversed(group.split(".")), version, kind])


def document(
    entries: Iterable[Entry], group: str, version: str, schemas: Schemas
) -> dict[str, Any] | None:
    paths: dict[str, Any] = {}
    components: dict[str, Any] = {}
    for resource, info, _ in entries:
        if (resource.group or "", resource.version) != (group, version) or not resource.plural:
            continue
        scope = "namespaces/{namespace}/" if info.namespaced else ""
        gvk = {"group": group, "version": version, "kind": info.kind or resource.plural}
        paths[f"/{_prefix(group, version)}/{scope}{resource.plural}/{{name}}"] = {
            "patch": {
                "operationId": f"patch{gvk['kind']}",
                "parameters": [PARAMETER],
                "responses": {"200": {"description": "OK"}},
                "x-kubernetes-action": "patch",
                "x-kubernetes-group-version-kind": gvk,
            }
        }
        if (schema := schemas.get((group, version, resource.plural))) is not None:
            name = _schema_name(group, version, gvk["kind"])
            components[name] = {**schema, "x-kubernetes-group-version-kind": [gvk]}
    if not paths:
        return None
    return {
        "openapi": "3.0.0",
        "info": {"title": "kvfence devcluster", "version": "v1.32.0"},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": components},
    }


def root(entries: list[Entry], schemas: Schemas) -> dict[str, Any]:
    """`/openapi/v3`: every group-version's document, addressed with a hash of its content
    (kubectl caches them by URL, so a CRD applied later changes the hash)."""
    listed = {}
    for group, version in sorted(_group_versions(entries)):
        text = json.dumps(document(entries, group, version, schemas), sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:32].upper()
        prefix = _prefix(group, version)
        listed[prefix] = {"serverRelativeURL": f"/openapi/v3/{prefix}?hash={digest}"}
    return {"paths": listed}
