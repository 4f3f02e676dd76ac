"""What the unit tests that run a whole reconcile pass share: the InferenceDeployment's body
as kopf hands it to the timer, and pool readers for the pass's probes."""

from typing import Any

from kvfence_engine.contracts import PoolGateReport
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.decisions.pool_gate import PodPool


def tiny_spec(**service: Any) -> InferenceDeploymentSpec:
    """builtin:tiny-random at contextLength 1024, API keys in Secret `keys`; `service` is
    spec.router.service."""
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"source": "builtin:tiny-random"},
            "contextLength": 1024,
            "router": {"apiKeysSecret": "keys", "service": service},
        }
    )


def body(uid: str = "uid-infd") -> dict[str, Any]:
    """default/tiny with tiny_spec(), as kopf hands it to the timer (no status yet)."""
    return {
        "metadata": {"name": "tiny", "namespace": "default", "uid": uid, "generation": 1},
        "spec": tiny_spec().model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def never_probed(pod: str, *_: Any) -> Any:
    """A pool reader for passes that must probe no pod."""
    raise AssertionError(f"{pod} was probed")


def sufficient(pod: str, role: str, revision: str, url: str | None, token: str | None) -> PodPool:
    """A pool reader: every pod reports a pool of 2048 tokens with every defence on."""
    report = PoolGateReport(role=role, revision=revision, pool_tokens=2048, page_size=16,
                            num_pages=128, context_length_effective=2048, tag_check=True,
                            deferred_release=True)  # fmt: skip
    return PodPool(pod, role, revision, report=report)
