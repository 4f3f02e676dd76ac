"""Every write a pass makes, in one place: claim (create, or find the name taken), ensure a
revision's children as declared, re-run a canary, gate engine pods, write and push the routers'
backends, start a canary, fence the routers, point the stable Service, retire what is no longer
kept.

What the API refuses (a quota's 403, a webhook's 422) and names someone else holds are said in
the pass's Findings, never raised: the pass goes on, and its status says what it met. Nothing
is created once the watch reported the InferenceDeployment deleted (what a pass in flight would
create names a gone owner, and the garbage collector deletes it).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvfence_engine.contracts import TenantRequests
from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.canary_job import canary_job_name
from kvfence_operator.builders.engine_deployment import ENGINE_ROLES
from kvfence_operator.builders.metrics import MetricsAccess
from kvfence_operator.builders.network_policy import build_router_network_policy
from kvfence_operator.builders.secret import (
    RevisionCredentials,
    derived_mark,
    secret_name,
)
from kvfence_operator.cluster.cache import ClusterVerbs
from kvfence_operator.cluster.kube import KubeError, api_message
from kvfence_operator.cluster.prober import TenantRequestsReader, read_tenant_requests
from kvfence_operator.cluster.router_push import BackendsPusher
from kvfence_operator.decisions.declaration import declared_as
from kvfence_operator.decisions.draining import DRAINED_DELETION_COST
from kvfence_operator.decisions.drift import drift_patch, is_subset
from kvfence_operator.decisions.findings import Conflict, Findings, Problem, create_problem
from kvfence_operator.decisions.ownership import stable_service_patch
from kvfence_operator.decisions.pods import gate_event_due, gate_patch
from kvfence_operator.decisions.pool_gate import PodGate
from kvfence_operator.decisions.retirement import Retirement
from kvfence_operator.decisions.rollout import Event
from kvfence_operator.decisions.scaling import ScalingOutcome
from kvfence_operator.decisions.standing_canary import StandingPlan
from kvfence_operator.meta import (
    ANNOTATION_DRAINING,
    LABEL_ROLE,
    POD_DELETION_COST,
    Instance,
    controlled_by,
)
from kvfence_operator.reconcile.decide import Ensure, PassPlan, RevisionWrites, rerun_event

GATE_WRITE_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Acted:
    events: list[Event]  # of the writes that changed something worth an Event
    served: bool  # the stable Service is ours and selects the serving revision
    canary_refused: Problem | None = None  # the API refused the canary Job the plan starts
    # a failed standing run's window: each serving router's answer (decisions/standing_canary)
    exposure: tuple[tuple[str, TenantRequests | str], ...] = ()


@dataclass(frozen=True)
class Act:
    """One pass's writes for one InferenceDeployment; `found` is the pass's own Findings."""

    kube: ClusterVerbs
    instance: Instance
    found: Findings
    operator_namespace: str
    metrics: MetricsAccess
    credentials_key: bytes | None
    push_backends: BackendsPusher
    owner_deleted: Callable[[str], bool]
    read_tenants: TenantRequestsReader = read_tenant_requests

    def run(self, plan: PassPlan) -> Acted:
        """The plan's writes, in the order that keeps every invariant: children before the
        pods need them, gates and backends before the canary and the switch, the routers of
        the revision about to serve opened before the stable Service selects it, retirement
        last."""
        self.mark_draining(plan.scaling)
        for ensure in plan.ensure:
            self.ensure_revision(ensure)
        events = []
        if plan.rerun is not None:
            events.append(self.rerun_canary(plan.rerun, plan.rerun_value))
        for writes in plan.revisions:
            events += self.gate(writes)
            self.write_backends(writes)
        canary_refused = None
        if plan.canary_job is not None:
            canary_refused = self.start_canary(plan.canary_job)
        served = False
        if plan.stable_service is not None:
            self.fence_routers(plan.rollout.keep, plan.open_routers)
            served = self.serve(plan.stable_service)
        self.watch(plan.standing)
        exposure = self.exposed(plan)
        self.retire(plan.retirement)
        return Acted(events, served, canary_refused, exposure)

    # ---- ownership -----------------------------------------------------------------------

    def claim(self, obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Create `obj`. If its name is taken: the existing object when this
        InferenceDeployment controls it; otherwise None, the object left untouched and a
        Conflict found. (None too if it vanished in between: the next pass sees.)"""
        if self.owner_deleted(self.instance.uid):
            return None
        try:
            if self.kube.create(obj):
                return obj
        except KubeError as exc:  # forbidden (quota), rejected (422): said, and the pass goes on
            self._refused(obj, exc)
            return None
        meta = obj["metadata"]
        existing = self.kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if existing is None:
            return None
        if not controlled_by(existing, self.instance.uid):
            self.found.conflicts.append(Conflict.of({**existing, "kind": obj["kind"]}))
            return None
        return existing

    def _refused(self, obj: Mapping[str, Any], exc: KubeError) -> None:
        name = obj["metadata"]["name"]
        self.found.problems.append(create_problem(obj["kind"], name, exc.status, api_message(exc)))

    def _ours(self, obj: dict[str, Any] | None) -> dict[str, Any] | None:
        return obj if obj is not None and controlled_by(obj, self.instance.uid) else None

    # ---- children ------------------------------------------------------------------------

    def ensure_revision(self, ensure: Ensure) -> None:
        """Create what is missing and put back what someone else changed (drift.py). The
        Secret is generated once: its credentials live as long as the revision. A name
        someone else has stops the creation there: the pods come last, so they never start
        on credentials, a backends file or a fence that are not the operator's."""
        ns, revision, key = self.instance.namespace, ensure.revision, self.credentials_key
        secret = None
        if key is not None:  # derived: the Secret is created, never read (a 409: it exists)
            credentials = RevisionCredentials.derive(key, self.instance, revision)
        else:
            secret = self.kube.get("v1", "Secret", ns, secret_name(self.instance, revision))
            if secret is not None and not controlled_by(secret, self.instance.uid):
                self.found.conflicts.append(Conflict.of({**secret, "kind": "Secret"}))
                return
            credentials = RevisionCredentials.generate()
        for child in build_revision_children(
            ensure.spec,
            self.instance,
            revision,
            credentials,
            self.operator_namespace,
            serving=ensure.serving,
            metrics=self.metrics,
            deployments_spec=ensure.deployments_spec,
            credentials_mark=derived_mark(key) if key is not None else None,
        ):
            kind = child["kind"]
            if kind == "Secret" and secret is not None:
                continue
            if kind == "Secret" and key is not None:
                self._create_unread(child)
                continue
            built = child
            if kind == "Deployment":  # recorded as built (declaration.py)
                child = declared_as(built, None, key, self.instance, revision)
            conflicts = len(self.found.conflicts)
            existing = self.claim(child)
            if len(self.found.conflicts) > conflicts:
                return
            if existing is None or kind == "Secret":
                continue
            if kind == "Deployment":  # as its record says, when an earlier release built it
                child = declared_as(built, existing, key, self.instance, revision)
                if not ensure.engine_replicas and _is_engine(child):  # a user's autoscaler's
                    child["spec"].pop("replicas", None)
            patch = drift_patch(child, existing)
            if patch is not None:
                self.kube.patch(child["apiVersion"], kind, ns, child["metadata"]["name"], patch)

    def mark_draining(self, scaling: ScalingOutcome) -> None:
        """Mark the pods a scale-down removes (meta.ANNOTATION_DRAINING, with the lowest
        deletion cost), and unmark those that serve again (decisions/draining.py)."""
        now = datetime.now(UTC).isoformat()
        for drain in scaling.drains.values():
            marks = {ANNOTATION_DRAINING: now, POD_DELETION_COST: DRAINED_DELETION_COST}
            for names, annotations in (
                (drain.mark, marks),
                (drain.unmark, dict.fromkeys(marks)),
            ):
                for name in names:
                    patch = {"metadata": {"annotations": annotations}}
                    try:
                        self.kube.patch("v1", "Pod", self.instance.namespace, name, patch)
                    except KubeError as exc:
                        if exc.status != 404:  # gone: nothing to drain
                            raise

    def _create_unread(self, secret: dict[str, Any]) -> None:
        """A derived revision Secret: created; a 409 says it exists (its content is the same
        derivation). A name someone else took is not detected here: that Secret's token is
        not the derived one, so the engines answer the operator's pool probe with 401 and no
        pod passes the gate (fail closed, PoolUnknown)."""
        if self.owner_deleted(self.instance.uid):
            return
        try:
            self.kube.create(secret)
        except KubeError as exc:  # forbidden (quota), rejected: said, and the pass goes on
            self._refused(secret, exc)

    def start_canary(self, job: Mapping[str, Any]) -> Problem | None:
        """Create the candidate's canary Job; what the API answered if it refused it (a quota,
        an admission policy), also found for Degraded."""
        problems = len(self.found.problems)
        self.claim(job)
        return self.found.problems[problems] if len(self.found.problems) > problems else None

    def watch(self, standing: StandingPlan) -> None:
        """The standing canary: start the run that is due, delete Jobs past its history. A
        Job the API refuses is a problem (Degraded), and the run has no verdict."""
        if standing.create is not None:
            self.claim(standing.create)
        for name in standing.delete:
            self.kube.delete("batch/v1", "Job", self.instance.namespace, name)

    def exposed(self, plan: PassPlan) -> tuple[tuple[str, TenantRequests | str], ...]:
        """Whom the serving revision's routers answered in a failure's window, when a standing
        run's failure was recorded this pass."""
        window = plan.standing.exposure
        status = plan.standing.status
        if window is None or status is None:
            return ()
        writes = next((w for w in plan.revisions if w.revision == status.revision), None)
        if writes is None:
            return ()
        since, until = window
        return tuple(
            (url, self.read_tenants(url, writes.token, since, until)) for url in writes.routers
        )

    def rerun_canary(self, revision: str, wanted: str) -> Event:
        """Delete the revision's canary Job (its pods with it): the user gave
        kvfence.dev/rerun-canary a new value; a fresh one starts once the revision is ready."""
        name = canary_job_name(self.instance, revision)
        self.kube.delete("batch/v1", "Job", self.instance.namespace, name)
        return rerun_event(revision, wanted)

    # ---- gates and backends --------------------------------------------------------------

    def gate(self, writes: RevisionWrites) -> list[Event]:
        return [event for pod, gate in writes.gates if (event := self._set_gate(pod, gate))]

    def _set_gate(self, pod: dict[str, Any], gate: PodGate) -> Event | None:
        """Set the pod's kvfence.dev/kv-pool condition when it changed, with an Event when the
        pod starts or stops taking traffic (pods.gate_event_due). The kubelet writes the same
        conditions list, so the write is guarded by resourceVersion; on a conflict the pod is
        read again and the write retried."""
        ns, name = self.instance.namespace, pod["metadata"]["name"]
        due = gate_event_due(pod, gate)
        for _ in range(GATE_WRITE_ATTEMPTS):
            patch = gate_patch(pod, gate)
            if patch is None:
                return None
            try:
                self.kube.patch("v1", "Pod", ns, name, patch, subresource="status")
                break
            except KubeError as exc:
                if exc.status != 409:
                    raise
                fresh = self.kube.get("v1", "Pod", ns, name)
                if fresh is None:
                    return None
                pod = fresh
        else:
            return None  # still contended: the next pass writes it
        if not due:
            return None
        return Event("Normal" if gate.sufficient else "Warning", gate.reason, gate.message)

    def write_backends(self, writes: RevisionWrites) -> None:
        """The router ConfigMap (the routers' start-up source) holds the backends file, and
        each router that may serve is given it now (router_push)."""
        configmap = writes.configmap
        existing = self.claim(configmap)
        wanted = {
            "metadata": {"annotations": configmap["metadata"]["annotations"]},
            "data": configmap["data"],
        }
        if existing is not None and not is_subset(wanted, existing):
            name = configmap["metadata"]["name"]
            self.kube.patch("v1", "ConfigMap", self.instance.namespace, name, wanted)
        self.push_backends(list(writes.routers), writes.backends, writes.token)

    # ---- serving -------------------------------------------------------------------------

    def fence_routers(self, keep: tuple[str, ...], open_: frozenset[str]) -> None:
        """Open the routers of the revision the stable Service is about to select (before the
        switch, so no client meets a closed router) and of those draining after a switch;
        close every other kept revision's (a candidate's, until its promotion)."""
        ns = self.instance.namespace
        for revision in keep:
            policy = build_router_network_policy(
                self.instance, revision, self.operator_namespace, revision in open_, self.metrics
            )
            name = policy["metadata"]["name"]
            existing = self._ours(self.kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, name))
            patch = drift_patch(policy, existing) if existing is not None else None
            if patch is not None:
                self.kube.patch("networking.k8s.io/v1", "NetworkPolicy", ns, name, patch)

    def serve(self, service: dict[str, Any]) -> bool:
        """Make the stable Service what the spec declares. False when the name is someone
        else's Service (left untouched; a NameConflict)."""
        existing = self.claim(service)
        if existing is None:
            return False
        patch = stable_service_patch(existing, service)
        if patch is not None:
            name = service["metadata"]["name"]
            self.kube.patch("v1", "Service", self.instance.namespace, name, patch)
        return True

    def retire(self, retirement: Retirement) -> None:
        ns = self.instance.namespace
        for api_version, kind, name in retirement.children:
            self.kube.delete(api_version, kind, ns, name)
        for revision in retirement.derived:  # created, never read, by this operator
            self.kube.delete("v1", "Secret", ns, secret_name(self.instance, revision))
        for revision in retirement.unread:
            name = secret_name(self.instance, revision)
            try:  # an older operator's: deleted only if ours, which takes reading it
                secret = self.kube.get("v1", "Secret", ns, name)
            except KubeError as exc:
                if exc.status != 403:
                    raise
                continue  # no `get`: it goes with the InferenceDeployment (ownerReference)
            if self._ours(secret):
                self.kube.delete("v1", "Secret", ns, name)


def _is_engine(deployment: Mapping[str, Any]) -> bool:
    role = ((deployment.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE)
    return role in {str(r) for r in ENGINE_ROLES}
