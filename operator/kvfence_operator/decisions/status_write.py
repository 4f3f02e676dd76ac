"""Status is written only when it changes: a steady pass writes nothing."""

from collections.abc import Mapping
from typing import Any


def merged(target: Any, patch: Any) -> Any:
    """`patch` applied to `target` as a JSON merge patch (RFC 7386) is applied."""
    if not isinstance(patch, Mapping):
        return patch
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merged(result.get(key), value)
    return result


def status_changes(current: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Would merging `new` into the stored status change it?"""
    held = dict(current or {})
    return bool(merged(held, new) != held)
