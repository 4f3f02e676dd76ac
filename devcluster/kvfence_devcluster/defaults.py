"""What the real API server fills in on write, for the kinds kvfence creates.

Defaulting matters to tests because code that compares what it sent with what it reads back
must cope with these fields, as it would in a real cluster.
"""

import base64
from typing import Any


def _container(container: dict[str, Any]) -> None:
    container.setdefault("terminationMessagePath", "/dev/termination-log")
    container.setdefault("terminationMessagePolicy", "File")
    image = str(container.get("image", ""))
    latest = ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")
    container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
    for port in container.get("ports") or []:
        port.setdefault("protocol", "TCP")


def pod_spec(spec: dict[str, Any], restart_policy: str = "Always") -> None:
    spec.setdefault("restartPolicy", restart_policy)
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        _container(container)


def _job(job: dict[str, Any], creating: bool) -> None:
    spec = job.setdefault("spec", {})
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completions", 1)
    spec.setdefault("parallelism", 1)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    template = spec.setdefault("template", {})
    if creating and not spec.get("manualSelector"):
        # The Job controller's generated selector and the labels it adds to the template.
        meta = job["metadata"]
        uid, name = meta["uid"], meta["name"]
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        template.setdefault("metadata", {}).setdefault("labels", {}).update(
            {
                "batch.kubernetes.io/controller-uid": uid,
                "batch.kubernetes.io/job-name": name,
                "controller-uid": uid,
                "job-name": name,
            }
        )
    pod_spec(template.setdefault("spec", {}), restart_policy="Never")


def _deployment(deployment: dict[str, Any]) -> None:
    spec = deployment.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    spec.setdefault(
        "strategy",
        {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
    )
    pod_spec(spec.setdefault("template", {}).setdefault("spec", {}))


def _service(service: dict[str, Any]) -> None:
    spec = service.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec.get("clusterIP"):  # Store allocates it (a loopback address the proxy serves)
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))


def _secret(secret: dict[str, Any]) -> None:
    secret.setdefault("type", "Opaque")
    string_data = secret.pop("stringData", None) or {}
    data = secret.setdefault("data", {})
    for key, value in string_data.items():
        data[key] = base64.b64encode(str(value).encode()).decode()


def apply_defaults(group: str, plural: str, obj: dict[str, Any], creating: bool) -> None:
    match group, plural:
        case "", "pods":
            pod_spec(obj.setdefault("spec", {}))
        case "", "services":
            _service(obj)
        case "", "secrets":
            _secret(obj)
        case "apps", "deployments":
            _deployment(obj)
        case "batch", "jobs":
            _job(obj, creating)
