"""kopf handlers: thin. One startup function holds every setting; one timer runs the
level-based reconcile (reconcile.Reconciler) and writes its status and events."""

import contextlib
import logging
import os
from typing import Any

import kopf
from kubernetes import client

from kvfence_engine.core.faults import ALLOW_ENV
from kvfence_operator.app.finalizer_free import (
    deletion_reported,
    mark_deleted,
    not_deleted,
    remember_deletions,
    without_finalizer,
)
from kvfence_operator.app.in_flight import PassesInFlight
from kvfence_operator.app.metrics import PassOutcome
from kvfence_operator.cluster.cache import (
    SYNC_TIMEOUT_SECONDS,
    CachedKube,
    start_informers,
    wait_filled,
)
from kvfence_operator.cluster.crd_check import CrdCheck
from kvfence_operator.cluster.kube import Kube, load_cluster_config, with_retries
from kvfence_operator.cluster.metrics_token import metrics_access
from kvfence_operator.cluster.own_secrets import credentials_key
from kvfence_operator.cluster.prober import load_prober, pool_prober
from kvfence_operator.crd.types import (
    API_GROUP,
    API_VERSION,
    PLURAL,
    ConditionReason,
    InferenceDeploymentStatus,
)
from kvfence_operator.decisions.findings import CredentialsUnreadable, InvalidSpec
from kvfence_operator.decisions.status import (
    degraded_conditions,
    invalid_spec_conditions,
    read_status,
    status_changes,
)
from kvfence_operator.reconcile.reconciler import Reconciler

RECONCILE_INTERVAL_ENV = "KVFENCE_RECONCILE_INTERVAL"
OPERATOR_NAMESPACE_ENV = "OPERATOR_NAMESPACE"
RECONCILE_INTERVAL = float(os.environ.get(RECONCILE_INTERVAL_ENV, "5"))


def exact_namespaces(patterns: list[str] | None) -> list[str] | None:
    """The namespaces to cache; None (all) when kopf watches all or any by a glob."""
    if not patterns or any(c in p for p in patterns for c in "*?[]!,"):
        return None
    return list(patterns)


def api_client() -> client.ApiClient:
    """The cluster's client for the passes and the caches: a transient answer is retried
    inside the call (kube.with_retries)."""
    load_cluster_config()
    return client.ApiClient(with_retries(client.Configuration.get_default_copy()))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # No finalizer is set (finalizer_free); this name is the one older operators set, which
    # kopf removes from the objects that still carry it.
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    # Without timeouts a watch can stall silently behind a load balancer.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.posting.level = logging.WARNING  # events come from our own kopf.event calls
    settings.scanning.disabled = True  # namespaces come from the command line
    remember_deletions(memo)
    unsafe_faults_allowed = os.environ.get(ALLOW_ENV) == "1"
    if unsafe_faults_allowed:
        logging.warning(
            "%s=1: engine pods with unsafe faults pass the pool gate (tests only)", ALLOW_ENV
        )
    api = api_client()
    # watch-fed caches for the children (cache.py), filled before the first pass runs
    store, _informers = start_informers(api.configuration, exact_namespaces(memo.get("namespaces")))
    if not wait_filled(store, SYNC_TIMEOUT_SECONDS):
        logging.warning("the child caches are not filled yet: passes read from the API until then")
    kube = Kube(api)
    memo.crd = CrdCheck(kube)
    if (outdated := memo.crd.outdated()) is not None:
        logging.error("%s", outdated)
    namespace = os.environ.get(OPERATOR_NAMESPACE_ENV, "kvfence-system")
    memo.reconciler = Reconciler(
        CachedKube(kube, store),
        namespace,
        unsafe_faults_allowed=unsafe_faults_allowed,
        prober=pool_prober(),
        load_prober=load_prober(),
        metrics=metrics_access(kube, namespace, os.environ),
        credentials_key=credentials_key(kube, namespace, os.environ),
        owner_deleted=deletion_reported(memo),
    )


kopf.on.event(API_GROUP, API_VERSION, PLURAL)(mark_deleted)


@without_finalizer
@kopf.timer(
    API_GROUP,
    API_VERSION,
    PLURAL,
    interval=RECONCILE_INTERVAL,
    initial_delay=0,
    when=not_deleted,
)
def reconcile(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    meta = body["metadata"]
    in_flight: PassesInFlight | None = memo.get("in_flight")
    # Counted when the pass ends, however it ends (app/metrics.py); a stopping operator waits
    # for it before it gives up its Lease (app/in_flight.py).
    with (
        in_flight.running() if in_flight is not None else contextlib.nullcontext(),
        memo.metrics.counting(meta["namespace"], meta["name"]) as record,
    ):
        crd: CrdCheck | None = memo.get("crd")
        if crd is not None and (outdated := crd.outdated()) is not None:
            # Nothing is read or written but this condition: every write would lose fields.
            record.outcome = PassOutcome.CRD_OUTDATED
            reason = ConditionReason.CRD_OUTDATED
            if _report_degraded(body, patch, reason, outdated):
                kopf.event(body, type="Warning", reason=reason, message=outdated)
                logger.error("%s", outdated)
            return
        try:
            outcome = memo.reconciler.reconcile(body)
        except InvalidSpec as exc:
            # The API server validates the same schema, so this is a spec the CRD let through
            # (an older CRD, or a cluster without CEL): say so and stop retrying it.
            record.outcome = PassOutcome.INVALID_SPEC
            _report_invalid(body, patch, str(exc))
            raise kopf.PermanentError(f"invalid spec: {exc}") from exc
        except CredentialsUnreadable as exc:
            # Said on Degraded (once, not every pass) and tried again next pass; Ready and the
            # rest of the status stay as the last full pass left them.
            record.outcome = PassOutcome.CREDENTIALS_UNREADABLE
            reason = ConditionReason.CREDENTIALS_UNREADABLE
            if _report_degraded(body, patch, reason, str(exc)):
                kopf.event(body, type="Warning", reason=reason, message=str(exc))
            logger.warning("%s", exc)
            return
        memo.metrics.scaling(meta["namespace"], meta["name"], outcome.status.autoscaling)
        memo.metrics.conditions(meta["namespace"], meta["name"], outcome.status)
        memo.metrics.canaries(
            meta["namespace"],
            meta["name"],
            read_status(body.get("status"), meta["name"]),
            outcome.status,
        )
        status = outcome.status.model_dump(mode="json", by_alias=True)
        if status_changes(body.get("status"), status):  # an unchanged status is not written
            patch.status.update(status)
        for event in outcome.events:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
            logger.info("%s: %s", event.reason, event.message)


def _report_degraded(
    body: kopf.Body, patch: kopf.Patch, reason: ConditionReason, message: str
) -> bool:
    """Set Degraded True with `reason` and `message`, nothing else; False (and nothing
    written) when it already says so."""
    previous, generation = _stored(body)
    conditions = degraded_conditions(previous, reason, message, generation)
    written = [c.model_dump(mode="json", by_alias=True) for c in conditions]
    if not status_changes(body.get("status"), {"conditions": written}):
        return False
    patch.status["conditions"] = written
    return True


def _report_invalid(body: kopf.Body, patch: kopf.Patch, message: str) -> None:
    previous, generation = _stored(body)
    conditions = invalid_spec_conditions(previous, message, generation)
    patch.status["conditions"] = [c.model_dump(mode="json", by_alias=True) for c in conditions]
    patch.status["observedGeneration"] = generation


def _stored(body: kopf.Body) -> tuple[InferenceDeploymentStatus, int]:
    meta = body["metadata"]
    status = read_status(body.get("status"), f"{meta.get('namespace')}/{meta.get('name')}")
    return status, int(meta.get("generation") or 1)
