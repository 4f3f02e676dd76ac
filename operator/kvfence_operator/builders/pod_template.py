"""Pod pieces every kvfence workload shares: security context, scratch space, the model
volume, probes, resources and the user's pod overrides."""

import math
import re
from collections.abc import Sequence
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvfence_engine.tools.cache_dir import WEIGHTS_CACHE_ENV
from kvfence_operator.crd.types import (
    MODEL_MOUNT_PATH,
    PRE_STOP_SECONDS,
    ModelSpec,
    PodOverrides,
    Resources,
    RolloutSpec,
)
from kvfence_operator.meta import HTTP_PORT

RUN_AS_ID = 65532  # the images' non-root user
CREDENTIALS_DIR = "/var/run/kvfence"
INTERNAL_TOKEN_FILE = f"{CREDENTIALS_DIR}/internal-token"
TERMINATION_LOG = "/dev/termination-log"  # the kubelet shows it as the container's message
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_GPU_RESOURCES: dict[str, Any] = {
    "requests": {GPU_RESOURCE: 1},
    "limits": {GPU_RESOURCE: 1},
}


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_ID,
        "runAsGroup": RUN_AS_ID,
        "fsGroup": RUN_AS_ID,  # makes the 0440 secret files readable by the container user
        # chown a volume only when its root is not the group's yet: not every file of a
        # writable model volume at every pod start
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """The only writable path: the root filesystem is read-only."""
    return (
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "tmp", "mountPath": "/tmp"},
    )


def home_in_tmp() -> dict[str, str]:
    """Libraries that cache under $HOME need it writable."""
    return {"name": "HOME", "value": "/tmp"}


def no_weights_cache() -> dict[str, str]:
    """Engines keep no converted (float32) weights cache: HOME is the small scratch volume, a
    7B model's conversion is ~28 GB, and an emptyDir dies with the pod, so it would only save
    the conversion on a container restart."""
    return {"name": WEIGHTS_CACHE_ENV, "value": "off"}


def model_volume(model: ModelSpec) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The user's model volume, read-only at MODEL_MOUNT_PATH; none for builtin models."""
    if model.volume is None:
        return []
    return [
        (
            {**model.volume, "name": "model"},
            {"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True},
        )
    ]


def http_probes() -> dict[str, Any]:
    """/readyz answers once weights and pool exist; /healthz while the process lives."""
    return {
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def pre_stop() -> dict[str, Any]:
    """A stopping server waits before its SIGTERM, still serving, while endpoints and
    kube-proxies drop the pod (they learn of the deletion asynchronously); the native sleep
    action, so the image needs no shell."""
    return {"lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}}}


def drain_seconds(rollout: RolloutSpec) -> int:
    """How long a server lets its requests and streams in flight finish after SIGTERM (its
    --drain-seconds): the rest of the grace period after the preStop sleep."""
    return rollout.termination_grace_period_seconds - PRE_STOP_SECONDS


def http_port() -> dict[str, Any]:
    return {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}


def engine_resources(resources: Resources | None, ranks: int = 1) -> dict[str, Any]:
    """A GPU per rank unless the user wrote resources, which then replace the default as a
    whole."""
    if resources is None:
        return {kind: {GPU_RESOURCE: ranks} for kind in DEFAULT_GPU_RESOURCES}
    return resources.model_dump(exclude_defaults=True)


def _positive(quantity: int | str) -> bool:
    number = re.match(r"[+-]?[0-9.]+", str(quantity))
    return number is not None and float(number.group()) > 0


def cpu_threads(resources: dict[str, Any]) -> int | None:
    """Torch CPU threads for a container: its CPU limit, else its CPU request, rounded up.
    Torch otherwise starts a thread per core of the node, and engines sharing cores then
    stall each other at every parallel region (their threads spin while waiting)."""
    for section in ("limits", "requests"):
        quantity = resources.get(section, {}).get("cpu")
        if quantity is not None and _positive(quantity):
            return max(1, math.ceil(parse_quantity(quantity)))
    return None


def pod_template(
    *,
    pod_labels: dict[str, str],
    containers: list[dict[str, Any]],
    volumes: list[dict[str, Any]],
    overrides: PodOverrides | None = None,
    readiness_gates: Sequence[str] = (),
    restart_policy: str | None = None,
    termination_grace_period_seconds: int | None = None,
) -> dict[str, Any]:
    """A hardened pod template; the user's overrides add scheduling and metadata only."""
    overrides = overrides or PodOverrides()
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # no kvfence workload talks to the API server
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": containers,
        "volumes": volumes,
    }
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    if termination_grace_period_seconds is not None:
        spec["terminationGracePeriodSeconds"] = termination_grace_period_seconds
    if readiness_gates:
        spec["readinessGates"] = [{"conditionType": gate} for gate in readiness_gates]
    # the typed core/v1 shapes' empty defaults stay out, as the API server omits them
    scheduling = overrides.model_dump(
        by_alias=True,
        exclude_none=True,
        exclude_defaults=True,
        include={
            "node_selector",
            "tolerations",
            "affinity",
            "topology_spread_constraints",
            "priority_class_name",
            "runtime_class_name",
            "image_pull_secrets",
        },
    )
    spec.update({key: value for key, value in scheduling.items() if value})
    metadata: dict[str, Any] = {"labels": {**overrides.labels, **pod_labels}}
    if overrides.annotations:
        metadata["annotations"] = dict(overrides.annotations)
    return {"metadata": metadata, "spec": spec}


def override_env(overrides: PodOverrides) -> list[dict[str, Any]]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in overrides.env]
