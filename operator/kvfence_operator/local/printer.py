"""`kubectl get infd -o wide`, without kubectl: the CRD's own printer columns, evaluated with
the same JSONPath expressions, so `kvfence up` shows exactly what a cluster user sees."""

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from jsonpath_ng.ext import parse

from kvfence_operator.crd.schema import printer_columns


def _age(timestamp: str, now: datetime) -> str:
    created = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = max(0, int((now - created).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def row(obj: Mapping[str, Any], now: datetime | None = None) -> list[str]:
    now = now or datetime.now(UTC)
    cells = [str(obj["metadata"]["name"])]
    for column in printer_columns():
        found = [m.value for m in parse("$" + column["jsonPath"]).find(obj)]
        if not found or found[0] is None:
            cells.append("<none>" if column["type"] != "date" else "<unknown>")
        elif column["type"] == "date":
            cells.append(_age(str(found[0]), now))
        else:
            cells.append(",".join(str(v) for v in found))
    return cells


def table(objects: Sequence[Mapping[str, Any]], now: datetime | None = None) -> str:
    header = ["NAME", *(c["name"].upper() for c in printer_columns())]
    rows = [header, *(row(obj, now) for obj in objects)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip()
        for r in rows
    )
