"""One reconcile pass for an InferenceDeployment: observe (reconcile/observe.py, reads only),
decide (reconcile/decide.py over the pure decisions/), act (reconcile/act.py, every write),
then the status (decisions/status.py) from what was decided and what the writes met.

Level-based: every pass recomputes everything from the cluster and the status, so a pass can be
repeated, interrupted or run by a freshly restarted operator with the same result. The
Reconciler holds only what every pass shares (the clients, the operator's settings): a pass's
own state (its Findings, its observations, its plan) are values of that pass, since kopf runs
the timers of different InferenceDeployments at once on one Reconciler.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kvfence_operator.builders.metrics import NO_METRICS_ACCESS, MetricsAccess
from kvfence_operator.cluster.cache import ClusterVerbs
from kvfence_operator.cluster.prober import (
    LoadReader,
    PoolReader,
    Prober,
    TenantRequestsReader,
    read_load,
    read_pool,
    read_tenant_requests,
)
from kvfence_operator.cluster.router_push import BackendsPusher, now_ms, push_backends
from kvfence_operator.crd.types import (
    AutoscalingMode,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
)
from kvfence_operator.decisions.autoscaling import PodLoad
from kvfence_operator.decisions.canary import rerun_value
from kvfence_operator.decisions.findings import Findings, InvalidSpec, keys_secret_problem
from kvfence_operator.decisions.pool_gate import PodPool
from kvfence_operator.decisions.rollout import (
    Event,
    canary_refused,
    sealed_revision,
    selected_revision,
    serving_revision,
)
from kvfence_operator.decisions.standing_canary import with_exposure
from kvfence_operator.decisions.status import (
    compute_status,
    conflict_events,
    pool_events,
    problem_events,
    read_status,
    with_conflicts,
)
from kvfence_operator.meta import Instance, service_url
from kvfence_operator.reconcile.act import Act
from kvfence_operator.reconcile.decide import PassInputs, decide
from kvfence_operator.reconcile.history import ScalingHistory
from kvfence_operator.reconcile.observe import Observer
from kvfence_operator.revision import revision_of


@dataclass(frozen=True, slots=True)
class Outcome:
    status: InferenceDeploymentStatus
    events: list[Event] = field(default_factory=list)


@dataclass
class Reconciler:
    kube: ClusterVerbs
    operator_namespace: str
    read_pool: PoolReader = read_pool
    unsafe_faults_allowed: bool = False  # tests only: a pod's unsafe faults pass the pool gate
    push_backends: BackendsPusher = push_backends  # router_push: to the revision's routers
    metrics: MetricsAccess = NO_METRICS_ACCESS  # how Prometheus reaches the pods (metrics_token)
    # own_secrets.credentials_key: revision credentials derived, revision Secrets never read
    credentials_key: bytes | None = None
    # the operator's: pools read once per container instance, off the pass (prober.py);
    # None: read_pool is called in the pass (unit tests, callers with a fake reader)
    prober: Prober[PodPool] | None = None
    # the engines' loads for the autoscaler, the same way (prober.load_prober), re-read
    # every second; the recommendations it made, in memory (history.py)
    read_load: LoadReader = read_load
    load_prober: Prober[PodLoad] | None = None
    history: ScalingHistory = field(default_factory=ScalingHistory)
    # whether the watch reported this InferenceDeployment uid DELETED (finalizer_free): a
    # pass in flight when it goes creates nothing more (what it created before names a gone
    # owner, and the garbage collector deletes it)
    owner_deleted: Callable[[str], bool] = lambda _uid: False
    # a router's answer to whom it served in a window (a failed standing canary's)
    read_tenants: TenantRequestsReader = read_tenant_requests

    def reconcile(self, body: Mapping[str, Any]) -> Outcome:
        meta = body["metadata"]
        try:
            spec = InferenceDeploymentSpec.model_validate(body["spec"])
        except ValidationError as exc:
            raise InvalidSpec(str(exc)) from exc
        instance = Instance(meta["name"], meta["namespace"], meta["uid"])
        generation = int(meta.get("generation") or 1)
        previous = read_status(body.get("status"), f"{meta['namespace']}/{meta['name']}")
        desired = revision_of(spec)
        found = Findings()  # this pass's own

        # observe
        observer = Observer(
            self.kube,
            self.read_pool,
            self.prober,
            self.credentials_key,
            self.read_load,
            self.load_prober,
        )
        keys = spec.router.api_keys_secret
        frame = observer.frame(instance, keys)
        if not frame.keys_secret_exists:
            found.problems.append(keys_secret_problem(keys, instance.namespace))
        now = datetime.now(UTC)
        # status says which revision serves; a status that lost it is recovered from the
        # operator's seal on the stable Service, never from its selector (rollout.py)
        sealed = None
        if previous.revision is None or previous.revision.current is None:
            key = self.credentials_key
            sealed = sealed_revision(
                frame.stable,
                instance,
                lambda r: key if key is not None else _encoded(observer.token(instance, r)),
            )
        revision_status = serving_revision(previous.revision, sealed)
        current = revision_status.current if revision_status else None
        # none known: what the Service selects is kept (not served, not judged) until a
        # revision is promoted, so a lost status and seal never remove what may be serving
        held = selected_revision(frame.stable, instance.uid) if current is None else None
        # a retiring revision keeps its gates and backends while it drains
        retiring = [r.revision for r in (revision_status.retiring if revision_status else []) or []]
        kept = dict.fromkeys(r for r in (current, desired, *retiring) if r is not None)
        # the serving revision's loads, when the operator scales on them
        scaled = spec.autoscaling is not None and spec.autoscaling.mode is AutoscalingMode.OPERATOR
        watched = spec.canary.schedule is not None
        seen = {
            r: observer.revision(
                instance,
                r,
                desired=r == desired,
                loads=scaled and r == current,
                standing=watched and r == current,
            )
            for r in kept
        }

        # decide
        plan = decide(
            PassInputs(
                spec,
                instance,
                desired,
                revision_status,
                previous,
                frame,
                seen,
                rerun_value(body),
                held,
                self.history.of(instance.uid),
            ),
            now=now,
            now_ms=now_ms(),
            unsafe_faults_allowed=self.unsafe_faults_allowed,
            credentials_key=self.credentials_key,
        )

        self.history.record(instance.uid, plan.scaling.recommendations)
        found.problems.extend(plan.problems)
        found.conflicts.extend(plan.conflicts)

        # act
        acted = Act(
            self.kube,
            instance,
            found,
            self.operator_namespace,
            self.metrics,
            self.credentials_key,
            self.push_backends,
            self.owner_deleted,
            self.read_tenants,
        ).run(plan)
        standing, exposed = with_exposure(plan.standing, acted.exposure)

        # the status, from the plan and what the writes met
        endpoint = (
            service_url(instance, instance.name, spec.router.service.port) if acted.served else None
        )
        rollout = plan.rollout
        if acted.canary_refused is not None:
            rollout = canary_refused(rollout, acted.canary_refused.message)
        status = compute_status(
            spec,
            generation,
            previous,
            rollout,
            plan.observed,
            list(plan.pools),
            endpoint,
            now=datetime.now(UTC),
            problems=found.problems,
            autoscaling=plan.scaling.status,
            standing=standing,
        )
        events = [
            *acted.events,
            *rollout.events,
            *exposed,  # whom a failed standing run's window exposed
            *pool_events(previous, status),
            *problem_events(previous, status, found),
        ]
        status = with_conflicts(status, found.unique_conflicts(), generation, now=datetime.now(UTC))
        return Outcome(status, [*events, *conflict_events(previous, status, found)])


def _encoded(token: str | None) -> bytes | None:
    return token.encode() if token is not None else None
