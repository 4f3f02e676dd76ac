"""Children are kept as declared: whether a live child still holds what the operator declares
for it, and the one merge patch that puts it back.

Someone else's edit (`kubectl set image` on a revision's Deployment, an edited NetworkPolicy
or Service) would otherwise ship what never ran a canary or open what is fenced. The compare
is `declared ⊆ live`, so fields the API server defaults and annotations or labels that tools
add are not drift, and an unchanged child is never written:

- every field the builder declares must hold its value (lists element by element, same length:
  an added container or argument is drift);
- in the lists other managers add to (`env`, `volumes`, `volumeMounts`, `imagePullSecrets`:
  a mutating webhook's env var, a CA bundle's volume), entries are matched by name: each one
  the operator declares must be there and hold, and entries others added stay, as server-side
  apply keeps another field manager's entries, except an env var named `KVFENCE_…` (the
  engine's own settings: one added is drift);
- label selectors (`selector`, `podSelector`, `namespaceSelector`) and NetworkPolicy rules
  must match exactly: a key added to one changes what it selects or admits;
- a declared empty list or null matches only an absent or empty one; a declared empty map
  declares nothing in it (the server may default its fields), except where exact;
- resource quantities compare by value (`1` and `"1"`, `0.5` and `500m`: the server stores
  them canonically);
- metadata: the labels the operator sets, and its controller ownerReference; others' labels,
  annotations and ownerReferences stay.

The patch is a JSON merge patch of what is declared (lists are replaced whole, keeping the
entries others added to the lists above; a selector's added keys are removed); fields the
operator does not declare and no one may rely on are left as they are, as server-side apply
with a field manager would. Pure functions; the reconciler reads and writes.
"""

from collections.abc import Mapping
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.revision import judged_spec, revision_of

# label selectors, and a NetworkPolicy's rules (a `from` added to a rule narrows who is admitted)
EXACT_KEYS = frozenset({"selector", "podSelector", "namespaceSelector", "ingress", "egress"})
QUANTITY_KEYS = frozenset({"requests", "limits"})
# lists whose entries are keyed by name and that others add entries to (see the module doc)
SHARED_LISTS = frozenset({"env", "volumes", "volumeMounts", "imagePullSecrets"})
RESERVED_ENV_PREFIX = "KVFENCE_"
# top-level fields that are not the child's declaration: identity, server-owned, or (a router
# ConfigMap's data and spec record) written from the pods' pools by the reconciler itself
NOT_DECLARED = frozenset({"apiVersion", "kind", "metadata", "status"})
OBSERVED_FIELDS = {"ConfigMap": frozenset({"data", "binaryData", "annotations"})}


def is_subset(wanted: Any, actual: Any) -> bool:
    """Does `actual` already hold everything in `wanted`? Servers add defaults, so equality
    would report a difference on every pass; a subset test does not."""
    if isinstance(wanted, Mapping):
        return isinstance(actual, Mapping) and all(
            k in actual and is_subset(v, actual[k]) for k, v in wanted.items()
        )
    if isinstance(wanted, list):
        return (
            isinstance(actual, list)
            and len(wanted) == len(actual)
            and all(is_subset(w, a) for w, a in zip(wanted, actual, strict=True))
        )
    return bool(wanted == actual)


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _named(entries: Any) -> bool:
    return isinstance(entries, list) and all(
        isinstance(e, Mapping) and isinstance(e.get("name"), str) for e in entries
    )


def _others(key: str, wanted: list[Any], live: Any) -> list[Any] | None:
    """The entries others added to a shared list (SHARED_LISTS) beside the declared ones, in
    their order; None when they may not stay (the list is not one others share, an entry has
    no name, or an env var takes the engine's reserved prefix)."""
    if key not in SHARED_LISTS or not _named(wanted) or not _named(live):
        return None
    declared = {e["name"] for e in wanted}
    added = [e for e in live if e["name"] not in declared]
    if key == "env" and any(e["name"].startswith(RESERVED_ENV_PREFIX) for e in added):
        return None
    return added


def holds(
    wanted: Any, live: Any, exact: bool = False, quantity: bool = False, key: str = ""
) -> bool:
    """Does `live` hold everything `wanted` declares (see the module doc)? `key`: the field
    `wanted` is the value of."""
    if wanted is None or wanted == [] or (wanted == {} and exact):
        return _empty(live) or (not exact and wanted == [] and _others(key, [], live) is not None)
    if isinstance(wanted, Mapping):
        if not isinstance(live, Mapping):
            return not wanted and live is None
        if exact and any(not _empty(v) for k, v in live.items() if k not in wanted):
            return False
        return all(
            holds(
                v,
                live.get(k),
                exact=exact or k in EXACT_KEYS,
                quantity=quantity or k in QUANTITY_KEYS,
                key=k,
            )
            for k, v in wanted.items()
        )
    if isinstance(wanted, list):
        if not exact and _others(key, wanted, live) is not None:
            by_name = {e["name"]: e for e in live}
            return all(
                e["name"] in by_name and holds(e, by_name[e["name"]], exact, quantity)
                for e in wanted
            )
        return (
            isinstance(live, list)
            and len(wanted) == len(live)
            and all(holds(w, a, exact, quantity) for w, a in zip(wanted, live, strict=True))
        )
    if quantity and isinstance(wanted, int | float | str) and isinstance(live, int | float | str):
        return _same_quantity(wanted, live)
    return bool(wanted == live)


def _same_quantity(wanted: int | float | str, live: int | float | str) -> bool:
    """The API server stores quantities canonically (`0.5` CPU as `500m`, `1` as `"1"`)."""
    try:
        return bool(parse_quantity(wanted) == parse_quantity(live))
    except ValueError:
        return str(wanted) == str(live)


def _exact(wanted: Any, live: Any) -> Any:
    """`wanted` as a merge patch that also removes whatever `live` has beyond it."""
    if not isinstance(wanted, Mapping):
        return wanted
    live_map = live if isinstance(live, Mapping) else {}
    patch: dict[str, Any] = {k: None for k in live_map if k not in wanted}
    patch.update({k: _exact(v, live_map.get(k)) for k, v in wanted.items()})
    return patch


def _patch_of(wanted: Any, live: Any) -> Any:
    if not isinstance(wanted, Mapping):
        return wanted
    live_map = live if isinstance(live, Mapping) else {}
    return {
        k: _exact(v, live_map.get(k))
        if k in EXACT_KEYS
        else _whole(k, v, live_map.get(k))
        if isinstance(v, list)
        else _patch_of(v, live_map.get(k))
        for k, v in wanted.items()
    }


def _whole(key: str, wanted: list[Any], live: Any) -> list[Any]:
    """A list as a merge patch sets it (whole): the declared entries, each with what others
    added to its own shared lists, then the entries others added beside them (_others)."""
    live_entries = {e["name"]: e for e in live} if _named(live) else {}

    def entry(declared: Any) -> Any:
        if not isinstance(declared, Mapping) or "name" not in declared:
            return declared
        current = live_entries.get(declared["name"])
        current_map = current if isinstance(current, Mapping) else {}
        return {
            k: _whole(k, v, current_map.get(k)) if isinstance(v, list) else v
            for k, v in declared.items()
        }

    return [entry(e) for e in wanted] + (_others(key, wanted, live) or [])


def declared_fields(child: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator declares of a child it built: every top-level field but identity and
    status (a router ConfigMap's data and annotations excepted, see OBSERVED_FIELDS), and its
    labels and annotations."""
    observed = OBSERVED_FIELDS.get(child["kind"], frozenset())
    meta = child["metadata"]
    declared: dict[str, Any] = {
        k: v for k, v in child.items() if k not in NOT_DECLARED and k not in observed
    }
    metadata = {
        k: dict(meta[k]) for k in ("labels", "annotations") if meta.get(k) and k not in observed
    }
    return {"metadata": metadata, **declared} if metadata else declared


def _owner_references(child: Mapping[str, Any], live: Mapping[str, Any]) -> list[Any] | None:
    """The live ownerReferences with the child's restored (others' kept), or None when the
    live ones already hold the child's."""
    ours = child["metadata"].get("ownerReferences") or []
    refs = list((live.get("metadata") or {}).get("ownerReferences") or [])
    missing = [
        ref for ref in ours if not any(r.get("uid") == ref["uid"] and holds(ref, r) for r in refs)
    ]
    if not missing:
        return None
    uids = {ref["uid"] for ref in ours}
    return [r for r in refs if r.get("uid") not in uids] + list(ours)


def drift_patch(child: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that makes `live` hold what `child` (the builder's object) declares;
    None when it already does."""
    declared = declared_fields(child)
    owners = _owner_references(child, live)
    if holds(declared, live) and owners is None:
        return None
    patch = _patch_of(declared, live)
    if owners is not None:
        patch.setdefault("metadata", {})["ownerReferences"] = owners
    return dict(patch)


def declaring_spec(
    revision: str, desired: str, spec: InferenceDeploymentSpec, record: str | None
) -> InferenceDeploymentSpec | None:
    """The spec a revision's children are declared from: the object's spec for the desired
    revision, the spec recorded on the revision for any other (revision.judged_spec), never
    the new spec, which would change a serving revision's pods without a canary. None when no
    spec of that revision can be read (no record, or one that does not hash to it): its
    children are then left as they are, and the pass says so (RevisionRecordRefused)."""
    judged = judged_spec(revision, desired, spec, record)
    return judged if judged is not None and revision_of(judged) == revision else None
