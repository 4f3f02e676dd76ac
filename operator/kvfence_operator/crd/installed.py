"""Whether the InferenceDeployment CRD the cluster serves is the one this operator was built
for.

Helm installs a chart's CRDs once and never upgrades them, so `helm upgrade` can leave a new
operator on an older schema. The API server then prunes the status fields that schema lacks
(`status.revision.retiring`, `status.progress`) from every write: a drained revision would be
deleted seconds after a promotion, the progress deadline would never fire, `Promoted` would be
said twice. The check compares field paths: every field of this operator's spec and status
must be in the schema the cluster publishes (its OpenAPI v3 document of the group-version,
readable by every authenticated client, so no RBAC beyond discovery). A newer CRD, with more
fields, is accepted. Pure: cluster/crd_check.py reads the document.
"""

from collections.abc import Mapping
from typing import Any

from kvfence_operator.crd.schema import CRD_NAME, build_crd
from kvfence_operator.crd.types import API_GROUP, API_VERSION, KIND

OPENAPI_PATH = f"/openapi/v3/apis/{API_GROUP}/{API_VERSION}"
# as Kubernetes names a CRD's schema in its OpenAPI documents: the group reversed
SCHEMA_NAME = ".".join([*reversed(API_GROUP.split(".")), API_VERSION, KIND])
CHECKED = ("spec", "status")
SHOWN = 4  # missing fields named in the message


def field_paths(schema: Mapping[str, Any] | None, prefix: str = "") -> set[str]:
    """Every field path a structural schema declares: `a.b`, `a[].c` for a list's items,
    `a.*.d` for a map's values."""
    if not isinstance(schema, Mapping):
        return set()
    paths: set[str] = set()
    for name, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}.{name}" if prefix else name
        paths |= {path, *field_paths(sub, path)}
    paths |= field_paths(schema.get("items"), f"{prefix}[]")
    additional = schema.get("additionalProperties")
    if isinstance(additional, Mapping):
        paths |= field_paths(additional, f"{prefix}.*")
    return paths


def built_schema() -> dict[str, Any]:
    version = build_crd()["spec"]["versions"][0]
    return dict(version["schema"]["openAPIV3Schema"])


def published_schema(document: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The InferenceDeployment schema in the group-version's OpenAPI v3 document, if any."""
    schemas = ((document or {}).get("components") or {}).get("schemas") or {}
    schema = schemas.get(SCHEMA_NAME)
    return schema if isinstance(schema, Mapping) else None


def missing_fields(published: Mapping[str, Any] | None) -> list[str]:
    """This operator's spec and status fields that the published schema lacks, sorted."""
    wanted = {p for p in field_paths(built_schema()) if p.split(".")[0] in CHECKED}
    return sorted(wanted - field_paths(published))


def outdated_message(missing: list[str]) -> str:
    more = len(missing) - SHOWN
    named = ", ".join(missing[:SHOWN]) + (f" and {more} more" if more > 0 else "")
    return (
        f"the installed CRD {CRD_NAME} is older than this operator: it lacks {named}, which "
        "the API server would drop from every write. Nothing is reconciled until it is "
        "upgraded: kubectl apply -f crds/ (from this release; Helm installs a "
        "chart's CRDs once and never upgrades them)"
    )
