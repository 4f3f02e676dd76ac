"""Server-side printing: the meta.k8s.io/v1 Table kubectl asks for (`Accept: application/json;
as=Table;v=v1;g=meta.k8s.io`) on get, list and watch, so `kubectl get` prints what it prints
against a kube-apiserver.

A custom resource's columns are its CRD version's `additionalPrinterColumns`, each JSONPath
evaluated against the object as the apiextensions server does (first match; `date` shown as
an age; a missing value is an empty cell). The built-in kinds kvfence creates or a user looks
at get their kube-apiserver columns (pods, deployments, services, jobs, events, secrets,
config maps, namespaces, leases, CRDs); any other kind gets NAME and AGE.
"""

import json
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from jsonpath_ng.exceptions import JsonPathParserError
from jsonpath_ng.ext import parse as parse_jsonpath

Column = dict[str, Any]  # a TableColumnDefinition
Cells = Callable[[dict[str, Any]], list[Any]]
NONE = "<none>"


def wants_table(accept: str) -> bool:
    """Whether an Accept header asks for a meta.k8s.io/v1 Table."""
    for media in accept.split(","):
        params = {
            key.strip(): value.strip()
            for key, _, value in (p.partition("=") for p in media.split(";")[1:])
        }
        wanted = (params.get("as"), params.get("g"), params.get("v"))
        if wanted == ("Table", "meta.k8s.io", "v1"):
            return True
    return False


def human_duration(seconds: float) -> str:
    """k8s.io/apimachinery/pkg/util/duration.HumanDuration, as kubectl's AGE column shows it."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        years, days = hours // 24 // 365, hours // 24 % 365
        return f"{years}y" if days == 0 else f"{years}y{days}d"
    return f"{hours // 24 // 365}y"


def age(timestamp: Any) -> str:
    if not isinstance(timestamp, str) or not timestamp:
        return "<unknown>"
    try:
        then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    return human_duration((datetime.now(UTC) - then).total_seconds())


def _column(name: str, kind: str = "string", priority: int = 0, **extra: str) -> Column:
    return {"name": name, "type": kind, "format": "", "description": "", "priority": priority} | (
        extra
    )


NAME = _column("Name", format="name", description="Name must be unique within a namespace.")
AGE = _column("Age", description="Time since creation.")


def _meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    return obj.get("metadata") or {}


def _created(obj: Mapping[str, Any]) -> str:
    return age(_meta(obj).get("creationTimestamp"))


# ---- custom resources ----------------------------------------------------------------------


@lru_cache(maxsize=256)
def _compiled(path: str) -> Any:
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    return parse_jsonpath("$" + (text if text.startswith((".", "[")) else "." + text))


def _custom_cell(column: Mapping[str, Any], obj: dict[str, Any]) -> Any:
    try:
        found = _compiled(column["jsonPath"]).find(obj)
    except JsonPathParserError:  # a column that does not parse shows nothing
        return None
    if not found:
        return None
    value = found[0].value
    match column.get("type"):
        case "date":
            return age(value) if isinstance(value, str) else None
        case "integer":
            return int(value) if isinstance(value, int | float) and value == int(value) else None
        case "number":
            return value if isinstance(value, int | float) else None
        case "boolean":
            return value if isinstance(value, bool) else None
        case _:
            if isinstance(value, str):
                return value
            if isinstance(value, dict | list):  # as client-go's JSONPath prints them
                return json.dumps(value, separators=(",", ":"))
            return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


def custom_columns(printer_columns: Iterable[Mapping[str, Any]]) -> tuple[list[Column], Cells]:
    """The Table columns of a CRD version with these additionalPrinterColumns (none: Age)."""
    declared = list(printer_columns) or [
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    ]
    columns = [NAME] + [
        _column(
            c["name"],
            c.get("type", "string"),
            int(c.get("priority") or 0),
            format=c.get("format", ""),
            description=c.get("description", ""),
        )
        for c in declared
    ]

    def cells(obj: dict[str, Any]) -> list[Any]:
        return [_meta(obj).get("name"), *(_custom_cell(c, obj) for c in declared)]

    return columns, cells


# ---- built-in kinds ------------------------------------------------------------------------


def _pod_status(pod: dict[str, Any]) -> str:
    """The STATUS kubectl shows: the pod's reason, else a container's waiting or terminated
    reason, else the phase; Terminating while being deleted."""
    status = pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or "Unknown"
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        if (waiting := state.get("waiting")) and waiting.get("reason"):
            reason = waiting["reason"]
        elif terminated := state.get("terminated"):
            reason = terminated.get("reason") or (
                f"Signal:{terminated['signal']}"
                if terminated.get("signal")
                else f"ExitCode:{terminated.get('exitCode')}"
            )
        elif state.get("running") and container.get("ready") and reason == "Completed":
            reason = "Running"
    if _meta(pod).get("deletionTimestamp"):
        reason = "Terminating"
    return str(reason)


def _pod_cells(pod: dict[str, Any]) -> list[Any]:
    status = pod.get("status") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for c in statuses if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in statuses)
    gates = (pod.get("spec") or {}).get("readinessGates") or []
    true = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
    gates_text = f"{sum(1 for g in gates if g.get('conditionType') in true)}/{len(gates)}"
    return [
        _meta(pod).get("name"),
        f"{ready}/{len(containers)}",
        _pod_status(pod),
        restarts,
        _created(pod),
        status.get("podIP") or NONE,
        (pod.get("spec") or {}).get("nodeName") or NONE,
        status.get("nominatedNodeName") or NONE,
        gates_text if gates else NONE,
    ]


def _containers(template_spec: Mapping[str, Any]) -> tuple[str, str]:
    containers = template_spec.get("containers") or []
    names = ",".join(c.get("name", "") for c in containers)
    images = ",".join(c.get("image", "") for c in containers)
    return names or NONE, images or NONE


def _selector(selector: Mapping[str, Any] | None) -> str:
    if not selector:
        return NONE
    labels = selector.get("matchLabels", selector) if "matchLabels" in selector else selector
    parts = [f"{k}={v}" for k, v in sorted(labels.items()) if isinstance(v, str)]
    for expression in selector.get("matchExpressions") or []:
        values = ",".join(expression.get("values") or [])
        parts.append(f"{expression.get('key')} {expression.get('operator', '').lower()} ({values})")
    return ",".join(parts) or NONE


def _deployment_cells(deployment: dict[str, Any]) -> list[Any]:
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    names, images = _containers(((spec.get("template") or {}).get("spec")) or {})
    return [
        _meta(deployment).get("name"),
        f"{int(status.get('readyReplicas') or 0)}/{int(spec.get('replicas', 1))}",
        int(status.get("updatedReplicas") or 0),
        int(status.get("availableReplicas") or 0),
        _created(deployment),
        names,
        images,
        _selector(spec.get("selector")),
    ]


def _service_cells(service: dict[str, Any]) -> list[Any]:
    spec = service.get("spec") or {}
    ports = ",".join(
        f"{p.get('port')}"
        + (f":{p['nodePort']}" if p.get("nodePort") else "")
        + f"/{p.get('protocol', 'TCP')}"
        for p in spec.get("ports") or []
    )
    external = spec.get("externalIPs") or []
    if spec.get("type") == "LoadBalancer":
        ingress = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        external = [i.get("ip") or i.get("hostname") for i in ingress] or ["<pending>"]
    return [
        _meta(service).get("name"),
        spec.get("type", "ClusterIP"),
        spec.get("clusterIP") or NONE,
        ",".join(external) or NONE,
        ports or NONE,
        _created(service),
        _selector(spec.get("selector")),
    ]


def _condition_true(obj: Mapping[str, Any], kind: str) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def _seconds(timestamp: Any) -> float | None:
    if not isinstance(timestamp, str):
        return None
    try:
        return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _job_cells(job: dict[str, Any]) -> list[Any]:
    spec, status = job.get("spec") or {}, job.get("status") or {}
    if _condition_true(job, "Complete"):
        state = "Complete"
    elif _condition_true(job, "Failed"):
        state = "Failed"
    elif _meta(job).get("deletionTimestamp"):
        state = "Terminating"
    elif spec.get("suspend"):
        state = "Suspended"
    else:
        state = "Running"
    start, end = _seconds(status.get("startTime")), _seconds(status.get("completionTime"))
    duration = (
        human_duration((end or datetime.now(UTC).timestamp()) - start) if start is not None else ""
    )
    names, images = _containers(((spec.get("template") or {}).get("spec")) or {})
    return [
        _meta(job).get("name"),
        state,
        f"{int(status.get('succeeded') or 0)}/{int(spec.get('completions') or 1)}",
        duration,
        _created(job),
        names,
        images,
        _selector(spec.get("selector")),
    ]


def _event_cells(event: dict[str, Any]) -> list[Any]:
    involved = event.get("involvedObject") or {}
    last = (
        event.get("lastTimestamp")
        or event.get("eventTime")
        or _meta(event).get("creationTimestamp")
    )
    source = event.get("source") or {}
    return [
        age(last),
        event.get("type", ""),
        event.get("reason", ""),
        f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}",
        str(event.get("message", "")).strip(),
        involved.get("fieldPath", ""),
        ", ".join(v for v in (source.get("component"), source.get("host")) if v),
        age(event.get("firstTimestamp") or last),
        int(event.get("count") or 1),
        _meta(event).get("name"),
    ]


def _data_count(obj: Mapping[str, Any]) -> int:
    return len(obj.get("data") or {}) + len(obj.get("binaryData") or {})


BUILTIN: dict[tuple[str, str], tuple[list[Column], Cells]] = {
    ("", "pods"): (
        [
            NAME,
            _column("Ready", description="The aggregate readiness state of this pod."),
            _column("Status", description="The aggregate status of the containers in this pod."),
            _column("Restarts", "integer", description="The number of container restarts."),
            AGE,
            _column("IP", priority=1),
            _column("Node", priority=1),
            _column("Nominated Node", priority=1),
            _column("Readiness Gates", priority=1),
        ],
        _pod_cells,
    ),
    ("apps", "deployments"): (
        [
            NAME,
            _column("Ready"),
            _column("Up-to-date", "integer"),
            _column("Available", "integer"),
            AGE,
            _column("Containers", priority=1),
            _column("Images", priority=1),
            _column("Selector", priority=1),
        ],
        _deployment_cells,
    ),
    ("", "services"): (
        [
            NAME,
            _column("Type"),
            _column("Cluster-IP"),
            _column("External-IP"),
            _column("Port(s)"),
            AGE,
            _column("Selector", priority=1),
        ],
        _service_cells,
    ),
    ("batch", "jobs"): (
        [
            NAME,
            _column("Status"),
            _column("Completions"),
            _column("Duration"),
            AGE,
            _column("Containers", priority=1),
            _column("Images", priority=1),
            _column("Selector", priority=1),
        ],
        _job_cells,
    ),
    ("", "events"): (
        [
            _column("Last Seen"),
            _column("Type"),
            _column("Reason"),
            _column("Object"),
            _column("Message"),
            _column("Subobject", priority=1),
            _column("Source", priority=1),
            _column("First Seen", priority=1),
            _column("Count", "integer", priority=1),
            _column("Name", priority=1),
        ],
        _event_cells,
    ),
    ("", "secrets"): (
        [NAME, _column("Type"), _column("Data", "integer"), AGE],
        lambda o: [_meta(o).get("name"), o.get("type", ""), _data_count(o), _created(o)],
    ),
    ("", "configmaps"): (
        [NAME, _column("Data", "integer"), AGE],
        lambda o: [_meta(o).get("name"), _data_count(o), _created(o)],
    ),
    ("", "namespaces"): (
        [NAME, _column("Status"), AGE],
        lambda o: [
            _meta(o).get("name"),
            (o.get("status") or {}).get("phase", ""),
            _created(o),
        ],
    ),
    ("coordination.k8s.io", "leases"): (
        [NAME, _column("Holder"), AGE],
        lambda o: [
            _meta(o).get("name"),
            (o.get("spec") or {}).get("holderIdentity", ""),
            _created(o),
        ],
    ),
    ("apiextensions.k8s.io", "customresourcedefinitions"): (
        [NAME, _column("Created At", "date")],
        lambda o: [_meta(o).get("name"), _meta(o).get("creationTimestamp")],
    ),
}
DEFAULT: tuple[list[Column], Cells] = (
    [NAME, AGE],
    lambda o: [_meta(o).get("name"), _created(o)],
)


def _row_object(obj: dict[str, Any], include: str) -> dict[str, Any] | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": _meta(obj)}


def table(
    printer: tuple[list[Column], Cells],
    objects: Iterable[dict[str, Any]],
    resource_version: str | None,
    include_object: str | None,
) -> dict[str, Any]:
    """A Table of these objects; `includeObject` (None, Metadata: the default, Object) says
    what each row carries besides its cells."""
    columns, cells = printer
    rows = []
    for obj in objects:
        row: dict[str, Any] = {"cells": cells(obj)}
        if (embedded := _row_object(obj, include_object or "Metadata")) is not None:
            row["object"] = embedded
        rows.append(row)
    metadata = {"resourceVersion": resource_version} if resource_version else {}
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": columns,
        "rows": rows,
    }
