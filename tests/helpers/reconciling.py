"""What the unit tests that run a whole reconcile pass share: the InferenceDeployment's body
as kopf hands it to the timer, the timer's pass itself (run_timer), and pool readers for the
pass's probes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from kvfence_engine.contracts import PoolGateReport
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.decisions.pool_gate import PodPool

if TYPE_CHECKING:  # kopf and the handlers are imported by run_timer only, when it runs
    import kopf


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


def run_timer(memo: kopf.Memo, obj: Mapping[str, Any]) -> kopf.Patch:
    """One pass of the operator's timer (app/handlers.py `reconcile`) on `obj`, called with the
    keyword arguments kopf gives a timer of a resource; the patch it leaves to kopf."""
    import kopf

    from kvfence_operator.app import handlers
    from kvfence_operator.crd.types import API_GROUP, API_VERSION, PLURAL

    body = kopf.Body(cast(kopf.RawBody, obj))  # an API object's JSON, as kopf receives it
    meta, patch = body.metadata, kopf.Patch()
    handlers.reconcile(
        annotations=meta.annotations,
        labels=meta.labels,
        body=body,
        meta=meta,
        spec=body.spec,
        status=body.status,
        resource=kopf.Resource(API_GROUP, API_VERSION, PLURAL),
        uid=meta.uid,
        name=meta.name,
        namespace=meta.namespace,
        patch=patch,
        logger=kopf.LocalObjectLogger(body=body, settings=kopf.OperatorSettings()),
        memo=memo,
    )
    return patch
