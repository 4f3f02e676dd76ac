"""The three patch formats the API server accepts: JSON merge patch (RFC 7386), JSON patch
(RFC 6902, with `test`, which kopf uses as a resourceVersion guard) and a strategic merge patch
covering the lists Kubernetes merges by key (conditions by type, containers by name, ...)."""

import copy
from typing import Any


class PatchError(ValueError):
    """The patch cannot be applied (422 Unprocessable Entity)."""


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# patchStrategy:"merge" lists of the built-in kinds and their patchMergeKey.
MERGE_KEYS = {
    "conditions": "type",
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "containerStatuses": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
    "hostAliases": "ip",
}
MERGED_SCALAR_LISTS = {"finalizers"}


def _merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":  # container ports merge by containerPort, Service ports by port
        return "containerPort" if any("containerPort" in i for i in items) else "port"
    return MERGE_KEYS.get(field)


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):  # directives ($setElementOrder, $retainKeys): ordering hints
            continue
        old = result.get(key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(old, list):
            result[key] = _merge_list(key, old, value)
        else:
            result[key] = strategic_merge_patch(old, value)
    return result


def _merge_list(field: str, old: list[Any], new: list[Any]) -> list[Any]:
    if field in MERGED_SCALAR_LISTS:
        return [*old, *(v for v in new if v not in old)]
    key = _merge_key(field, [*old, *new])
    dicts = all(isinstance(i, dict) for i in [*old, *new])
    if key is None or not dicts:
        return copy.deepcopy(new)
    merged = [copy.deepcopy(i) for i in old]
    for item in new:
        position = next((n for n, o in enumerate(merged) if o.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if position is not None:
                del merged[position]
        elif position is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[position] = strategic_merge_patch(merged[position], item)
    return merged


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts[:-1]:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise PatchError(f"path {path!r} does not exist") from None
    return node


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent = _parent(doc, parts, path)
    try:
        return parent[int(parts[-1])] if isinstance(parent, list) else parent[parts[-1]]
    except (KeyError, IndexError, ValueError, TypeError):
        raise PatchError(f"path {path!r} does not exist") from None


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    parent = _parent(doc, parts, path)
    try:
        if isinstance(parent, list):
            return parent.pop(int(parts[-1]))
        return parent.pop(parts[-1])
    except (KeyError, IndexError, ValueError, TypeError):
        raise PatchError(f"cannot remove {path!r}: it does not exist") from None


def _add(doc: Any, path: str, value: Any, replace: bool = False) -> Any:
    parts = _pointer(path)
    if not parts:
        return copy.deepcopy(value)
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if not 0 <= index <= len(parent) - (1 if replace else 0):
            raise PatchError(f"index out of range in {path!r}")
        if replace:
            parent[index] = copy.deepcopy(value)
        else:
            parent.insert(index, copy.deepcopy(value))
    elif isinstance(parent, dict):
        if replace and last not in parent:
            raise PatchError(f"cannot replace {path!r}: it does not exist")
        parent[last] = copy.deepcopy(value)
    else:
        raise PatchError(f"cannot add at {path!r}: parent is not a container")
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        kind, path = op.get("op"), op.get("path", "")
        if kind == "add":
            doc = _add(doc, path, op.get("value"))
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "replace":
            doc = _add(doc, path, op.get("value"), replace=True)
        elif kind == "move":
            doc = _add(doc, path, _remove(doc, op["from"]))
        elif kind == "copy":
            doc = _add(doc, path, _get(doc, op["from"]))
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchError(f"test failed: {path} is not {op.get('value')!r}")
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}")
    return doc
