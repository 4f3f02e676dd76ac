"""Label and field selectors, in both forms Kubernetes uses them.

The query-string form (`app=x,tier in (a,b),!canary`) filters list and watch requests; the
LabelSelector form (`matchLabels` + `matchExpressions`) is what Deployments and Jobs carry.
Both compile to the same list of requirements.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        match self.operator:
            case "=" | "in":
                return present and value in self.values
            case "!=" | "notin":
                return not present or value not in self.values
            case "exists":
                return present
            case "!exists":
                return not present
        raise AssertionError(self.operator)


Selector = tuple[Requirement, ...]

_SET_BASED = re.compile(r"^\s*(?P<key>[^\s!=(),]+)\s+(?P<op>in|notin)\s+\((?P<values>[^)]*)\)\s*$")
_EQUALITY = re.compile(r"^\s*(?P<key>[^\s!=(),]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s!=(),]*)\s*$")
_EXISTS = re.compile(r"^\s*(?P<neg>!?)\s*(?P<key>[^\s!=(),]+)\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b` -> [`a in (x,y)`, `b`]."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p for p in parts if p.strip()]


def parse_label_selector(text: str | None) -> Selector:
    if not text:
        return ()
    requirements = []
    for part in _split_top_level(text):
        if m := _SET_BASED.match(part):
            values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
            requirements.append(Requirement(m["key"], m["op"], values))
        elif m := _EQUALITY.match(part):
            op = "!=" if m["op"] == "!=" else "="
            requirements.append(Requirement(m["key"], op, frozenset([m["value"]])))
        elif m := _EXISTS.match(part):
            requirements.append(Requirement(m["key"], "!exists" if m["neg"] else "exists"))
        else:
            raise SelectorError(f"unable to parse requirement {part.strip()!r} in {text!r}")
    return tuple(requirements)


_EXPRESSION_OPERATORS = {
    "In": "in",
    "NotIn": "notin",
    "Exists": "exists",
    "DoesNotExist": "!exists",
}


def selector_from_label_selector(selector: Mapping[str, Any] | None) -> Selector:
    """A metav1.LabelSelector. Note: an empty one matches everything."""
    selector = selector or {}
    requirements = [
        Requirement(key, "=", frozenset([str(value)]))
        for key, value in (selector.get("matchLabels") or {}).items()
    ]
    for expression in selector.get("matchExpressions") or []:
        operator = _EXPRESSION_OPERATORS.get(expression.get("operator", ""))
        if operator is None:
            raise SelectorError(f"unknown matchExpressions operator in {expression!r}")
        values = frozenset(str(v) for v in expression.get("values") or [])
        requirements.append(Requirement(expression["key"], operator, values))
    return tuple(requirements)


def labels_match(selector: Selector, labels: Mapping[str, str] | None) -> bool:
    return all(r.matches(labels or {}) for r in selector)


def parse_field_selector(text: str | None) -> Selector:
    """`metadata.name=x,status.phase!=Running`: equality only, as in Kubernetes."""
    if not text:
        return ()
    requirements = []
    for part in _split_top_level(text):
        m = _EQUALITY.match(part)
        if m is None:
            raise SelectorError(f"field selectors support =, == and != only, got {part!r}")
        op = "!=" if m["op"] == "!=" else "="
        requirements.append(Requirement(m["key"], op, frozenset([m["value"]])))
    return tuple(requirements)


def field_value(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def fields_match(selector: Selector, obj: Mapping[str, Any]) -> bool:
    return all(r.matches({r.key: field_value(obj, r.key)}) for r in selector)
