"""Container resources a cluster admin accepts: which extended resources mean CUDA, and the CPU
and memory requests every engine gets unless the user names them (a pod without any is
BestEffort, the first evicted under node pressure)."""

import re
from typing import Any

from kvfence_operator.crd.types import is_cuda_resource

# What an engine asks for when the spec names no CPU or memory: enough to schedule it on a node
# with room for the engine process and the weights it loads. A limit is never added (the pod is
# Burstable); a big model wants its own numbers in spec.<role>.resources.
DEFAULT_ENGINE_REQUESTS: dict[str, str] = {"cpu": "1", "memory": "4Gi"}


def _positive(quantity: int | str) -> bool:
    number = re.match(r"[+-]?[0-9.]+", str(quantity))
    return number is not None and float(number.group()) > 0


def engine_device(resources: dict[str, Any]) -> str:
    """`cuda` when the container asks for an NVIDIA GPU, whole (nvidia.com/gpu) or a MIG slice
    (nvidia.com/mig-<profile>); `cpu` otherwise. Other vendors' GPUs are refused by the CRD
    (crd/types.py::is_cuda_resource): the engine image's torch is a CUDA build."""
    return (
        "cuda"
        if any(
            is_cuda_resource(name) and _positive(quantity)
            for section in ("requests", "limits")
            for name, quantity in resources.get(section, {}).items()
        )
        else "cpu"
    )


def with_default_requests(
    resources: dict[str, Any], defaults: dict[str, str] = DEFAULT_ENGINE_REQUESTS
) -> dict[str, Any]:
    """`resources` plus a request for each of cpu and memory that it names neither as a request
    nor as a limit (a limit alone makes the API server request as much; adding a smaller or
    larger request there could contradict it). The user's numbers always win."""
    requests = dict(resources.get("requests", {}))
    limits = resources.get("limits", {})
    for name, quantity in defaults.items():
        if name not in requests and name not in limits:
            requests[name] = quantity
    return {**resources, "requests": requests}
