"""One reconcile pass for an InferenceDeployment: observe the cluster, let the pure functions
decide (pool_gate.judge_pools, rollout.plan_rollout, status.compute_status), then close the gap.

Level-based: every pass recomputes everything from the cluster and the status, so a pass can be
repeated, interrupted or run by a freshly restarted operator with the same result.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kvfence_engine.contracts import BackendsFile
from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.canary_job import CONTAINER as CANARY_CONTAINER
from kvfence_operator.builders.canary_job import EXIT_FINDING, build_canary_job, canary_job_name
from kvfence_operator.builders.engine_deployment import ENGINE_ROLES
from kvfence_operator.builders.metrics import NO_METRICS_ACCESS, MetricsAccess
from kvfence_operator.builders.network_policy import build_router_network_policy
from kvfence_operator.builders.router_deployment import (
    BACKENDS_FILE_NAME,
    build_router_configmap,
    build_stable_service,
    router_backends,
)
from kvfence_operator.builders.secret import (
    CREDENTIALS_MARK,
    RevisionCredentials,
    derived_mark,
    internal_token_of,
    secret_name,
)
from kvfence_operator.cluster.cache import CachedKube
from kvfence_operator.cluster.kube import Kube, KubeError, is_subset
from kvfence_operator.cluster.prober import PoolProber, Probe, container_instance
from kvfence_operator.cluster.router_push import (
    BackendsPusher,
    now_ms,
    push_backends,
    versioned,
    written_backends,
)
from kvfence_operator.crd.types import (
    ConditionType,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    Role,
    RoleReplicas,
)
from kvfence_operator.decisions.canary_rerun import (
    ANNOTATION_RERUN_CANARY,
    rerun_requested,
    rerun_value,
)
from kvfence_operator.decisions.drift import declaring_spec, drift_patch
from kvfence_operator.decisions.health import (
    CredentialsUnreadable,
    InvalidSpec,
    Problem,
    create_problem,
    keys_secret_problem,
    may_serve,
    read_status,
)
from kvfence_operator.decisions.ownership import (
    NAME_CONFLICT,
    Conflict,
    pod_controlled_by_deployment,
    stable_service_patch,
)
from kvfence_operator.decisions.pool_gate import PodGate, PodPool, judge_pools, read_pool
from kvfence_operator.decisions.replicas import replica_counts, with_replicas
from kvfence_operator.decisions.revision import judged_spec, revision_of
from kvfence_operator.decisions.rollout import (
    CanaryOutcome,
    Event,
    JobPhase,
    RevisionObservation,
    plan_rollout,
    serving_revision,
)
from kvfence_operator.decisions.status import compute_status, with_conflicts
from kvfence_operator.meta import (
    ANNOTATION_SPEC,
    KV_POOL_GATE,
    LABEL_REVISION,
    Instance,
    child_name,
    controlled_by,
    selector,
    service_url,
)

PoolReader = Callable[[str, str, str, str | None, str | None], PodPool]

# The kinds a revision owns that the operator may list. Secrets are deleted by name: the
# operator has no list/watch on Secrets (least privilege), so they are found from the others.
REVISION_KINDS = (
    ("apps/v1", "Deployment"),
    ("batch/v1", "Job"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("policy/v1", "PodDisruptionBudget"),
)
GATE_WRITE_ATTEMPTS = 3


@dataclass(slots=True)
class Findings:
    """What one pass met besides the cluster's state, for its status and events: names taken
    by objects this InferenceDeployment does not control, and errors the API answered. A value
    of the pass, handed to what may add to it: kopf runs the timers of different
    InferenceDeployments at once on one Reconciler, so nothing of a pass lives on it."""

    conflicts: list[Conflict] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Outcome:
    status: InferenceDeploymentStatus
    events: list[Event] = field(default_factory=list)


def pod_url(pod: Mapping[str, Any]) -> str | None:
    """http://<pod IP>:<the container port named http>."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return f"http://{ip}:{port['containerPort']}"
    return None


def pod_condition(pod: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), None)


def gate_patch(pod: Mapping[str, Any], gate: PodGate) -> dict[str, Any] | None:
    """The pods/status merge patch that sets the gate condition, or None if it is already
    set. Merge patch replaces lists, so the whole conditions list is written, with the
    resourceVersion it was read at."""
    status = "True" if gate.sufficient else "False"
    old = pod_condition(pod, KV_POOL_GATE)
    if old is not None and (old.get("status"), old.get("message")) == (status, gate.message):
        return None
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    new = {
        "type": KV_POOL_GATE,
        "status": status,
        "reason": gate.reason,
        "message": gate.message,
        "lastProbeTime": None,
        "lastTransitionTime": (
            old["lastTransitionTime"] if old and old.get("status") == status else now
        ),
    }
    others = [
        c
        for c in (pod.get("status") or {}).get("conditions") or []
        if c.get("type") != KV_POOL_GATE
    ]
    return {
        "metadata": {"resourceVersion": pod["metadata"].get("resourceVersion")},
        "status": {"conditions": [*others, new]},
    }


def selected_revision(service: Mapping[str, Any] | None, uid: str) -> str | None:
    """The revision a stable Service selects, if it is this InferenceDeployment's (controlled
    by `uid`); None for no Service, someone else's, or one without a revision in its selector."""
    if service is None:
        return None
    owners = (service.get("metadata") or {}).get("ownerReferences") or []
    if not any(o.get("uid") == uid and o.get("controller") for o in owners):
        return None
    return ((service.get("spec") or {}).get("selector") or {}).get(LABEL_REVISION)


def canary_outcome(job: Mapping[str, Any], pods: list[dict[str, Any]]) -> CanaryOutcome:
    """A Job's verdict, with the canary's one-line summary from its termination message.

    Only exit 1 is a finding: the Job's podFailurePolicy fails it at once (reason
    PodFailurePolicy). A Job that failed otherwise has no verdict (CouldNotRun): its tries
    all could not run (BackoffLimitExceeded), or it ran out of time (DeadlineExceeded: a pod
    stuck Pending on its image, a canary slower than its timeout). A Job from before the
    podFailurePolicy (backoffLimit 0) is judged by its pod's exit code."""
    name = job["metadata"]["name"]
    conditions = {
        c.get("type"): c
        for c in (job.get("status") or {}).get("conditions") or []
        if c.get("status") == "True"
    }
    tries = sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    message = next((m for pod in reversed(tries) if (m := _termination_message(pod))), "")
    if "Complete" in conditions:
        return CanaryOutcome(name, JobPhase.SUCCEEDED, message)
    if "Failed" not in conditions:
        return CanaryOutcome(name, JobPhase.RUNNING, message)
    failed = conditions["Failed"]
    reason = failed.get("reason") or ""
    findings = [pod for pod in tries if _exit(pod) == EXIT_FINDING]
    if reason == "PodFailurePolicy" or findings:
        found = _termination_message(findings[-1]) if findings else message
        return CanaryOutcome(name, JobPhase.FAILED, found or f"job failed: {failed.get('message')}")
    attempts = sum((p.get("status") or {}).get("phase") == "Failed" for p in tries)
    why = {
        "BackoffLimitExceeded": f"no verdict in {attempts} tries",
        "DeadlineExceeded": "the Job ran past its activeDeadlineSeconds (a pod that never "
        "started, e.g. an image that does not pull, or a canary slower than its timeout)",
    }.get(reason, failed.get("message") or "the Job failed")
    last = _last_words(tries[-1]) if tries else ""
    return CanaryOutcome(
        name,
        JobPhase.COULD_NOT_RUN,
        f"could not run ({reason or 'Failed'}): {why}" + (f"; last try: {last}" if last else ""),
    )


def _canary_container(pod: Mapping[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((s for s in statuses if s.get("name") == CANARY_CONTAINER), {})


def _exit(pod: Mapping[str, Any]) -> int | None:
    terminated = (_canary_container(pod).get("state") or {}).get("terminated") or {}
    code = terminated.get("exitCode")
    return int(code) if code is not None else None


def _termination_message(pod: Mapping[str, Any]) -> str:
    terminated = (_canary_container(pod).get("state") or {}).get("terminated") or {}
    return str(terminated.get("message") or "").strip()


def _last_words(pod: Mapping[str, Any]) -> str:
    """What a try ended with: the canary's summary, else its exit code, else why its container
    is waiting (ImagePullBackOff: ...)."""
    state = _canary_container(pod).get("state") or {}
    if (said := _termination_message(pod)) or "terminated" in state:
        return said or f"exit code {state['terminated'].get('exitCode')}"
    waiting = state.get("waiting") or {}
    return ": ".join(str(w) for w in (waiting.get("reason"), waiting.get("message")) if w)


@dataclass
class Reconciler:
    kube: Kube | CachedKube
    operator_namespace: str
    read_pool: PoolReader = read_pool
    unsafe_faults_allowed: bool = False  # tests only: a pod's unsafe faults pass the pool gate
    push_backends: BackendsPusher = push_backends  # router_push: to the revision's routers
    metrics: MetricsAccess = NO_METRICS_ACCESS  # how Prometheus reaches the pods (metrics_token)
    # own_secrets.credentials_key: revision credentials derived, revision Secrets never read
    credentials_key: bytes | None = None
    # the operator's: pools read once per container instance, off the pass (prober.py);
    # None: read_pool is called in the pass (unit tests, callers with a fake reader)
    prober: PoolProber | None = None
    # whether the watch reported this InferenceDeployment uid DELETED (finalizer_free): a
    # pass in flight when it goes creates nothing more (what it created before names a gone
    # owner, and the garbage collector deletes it)
    owner_deleted: Callable[[str], bool] = lambda _uid: False

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
        events: list[Event] = []
        found = Findings()  # this pass's own: kopf runs passes of other objects at once

        keys = spec.router.api_keys_secret
        if not self._secret_exists(instance.namespace, keys):
            found.problems.append(keys_secret_problem(keys, instance.namespace))
        stable = self.kube.get("v1", "Service", instance.namespace, instance.name)
        now = datetime.now(UTC)
        revision_status = serving_revision(
            previous.revision, selected_revision(stable, instance.uid), now=now
        )
        current = revision_status.current if revision_status else None
        for revision in dict.fromkeys(r for r in (desired, current) if r is not None):
            record = None if revision == desired else self._spec_record(instance, revision)
            declaring = declaring_spec(revision, desired, spec, record)
            if declaring is not None:
                self._ensure_revision(
                    found, declaring, instance, revision, replica_counts(spec), revision == current
                )
        rerun = rerun_value(body)
        if desired != current:  # a candidate's canary only: the serving one's is never re-run
            events += self._rerun_canary(instance, desired, rerun)
        # a retiring revision keeps its gates and backends while it drains
        retiring = [
            r.revision for r in (revision_status.retiring if revision_status else None) or []
        ]
        observed: dict[str, RevisionObservation] = {}
        pools_of: dict[str, list[PodPool]] = {}
        for revision in {r for r in (current, desired, *retiring) if r is not None}:
            judged = judged_spec(revision, desired, spec, self._spec_record(instance, revision))
            observed[revision], pools_of[revision], gate_events = self._observe(
                found, judged, instance, revision
            )
            events += gate_events

        plan = plan_rollout(
            desired,
            revision_status,
            previous.canary,
            observed,
            spec.canary.enabled,
            now=now,
            retire_after_seconds=spec.rollout.retire_after_seconds,
        )
        events += plan.events
        if plan.start_canary is not None:
            context = observed[plan.start_canary].pools.effective_context
            self._claim(
                found, instance, build_canary_job(spec, instance, plan.start_canary, context, rerun)
            )
        endpoint = None
        if plan.serve is not None:
            # open: the revision about to serve, and those draining (their clients finish there)
            draining = [r.revision for r in plan.revision.retiring or []]
            self._fence_routers(instance, plan.keep, {plan.serve, *draining})
        if plan.serve is not None and self._serve(found, spec, instance, plan.serve):
            endpoint = service_url(instance, instance.name, spec.router.service.port)
        self._retire(instance, keep=set(plan.keep))
        status = compute_status(
            spec,
            generation,
            previous,
            plan,
            observed,
            pools_of.get(plan.judged, []),
            endpoint,
            now=datetime.now(UTC),
            problems=found.problems,
        )
        if found.problems and _degraded(previous) != _degraded(status):
            events += [Event("Warning", p.reason, p.message) for p in found.problems]
        conflicts = list(dict.fromkeys(found.conflicts))
        status = with_conflicts(status, conflicts, generation, now=datetime.now(UTC))
        if conflicts and _condition_message(previous, NAME_CONFLICT) != _condition_message(
            status, NAME_CONFLICT
        ):
            events += [Event("Warning", NAME_CONFLICT, c.message) for c in conflicts]
        return Outcome(status, events)

    # ---- ownership -----------------------------------------------------------------------

    def _claim(
        self, found: Findings, instance: Instance, obj: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        """Create `obj`. If its name is taken: the existing object when this
        InferenceDeployment controls it; otherwise None, the object left untouched and a
        NameConflict recorded. (None too if it vanished in between: the next pass sees.)
        Nothing is created once the InferenceDeployment is reported deleted: None."""
        if self.owner_deleted(instance.uid):
            return None
        try:
            if self.kube.create(obj):
                return obj
        except KubeError as exc:  # forbidden (quota), rejected (422): said, and the pass goes on
            found.problems.append(create_problem(obj["kind"], obj["metadata"]["name"], exc))
            return None
        meta = obj["metadata"]
        existing = self.kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if existing is None:
            return None
        if not controlled_by(existing, instance.uid):
            found.conflicts.append(Conflict.of({**existing, "kind": obj["kind"]}))
            return None
        return existing

    def _ours(self, instance: Instance, obj: dict[str, Any] | None) -> dict[str, Any] | None:
        """`obj` if this InferenceDeployment controls it, else None: never counted."""
        return obj if obj is not None and controlled_by(obj, instance.uid) else None

    # ---- children ------------------------------------------------------------------------

    def _ensure_revision(
        self,
        found: Findings,
        spec: InferenceDeploymentSpec,
        instance: Instance,
        revision: str,
        replicas: Mapping[str, int],
        serving: bool,
    ) -> None:
        """Create what is missing and put back what someone else changed (drift.py): every
        child as `spec` (the revision's own, drift.declaring_spec) declares it, with the
        revision-neutral `replicas`; `serving`: the revision serves (the current one: what the
        stable Service selects, or status says without one), so its routers are public.
        The Secret is generated once: its credentials live as long as the revision. A name
        someone else has stops the creation there: the pods come last, so they never start
        on credentials, a backends file or a fence that are not the operator's."""
        ns = instance.namespace
        key = self.credentials_key
        secret = None
        if key is not None:  # derived: the Secret is created, never read (a 409: it exists)
            credentials = RevisionCredentials.derive(key, instance, revision)
        else:
            secret = self.kube.get("v1", "Secret", ns, secret_name(instance, revision))
            if secret is not None and not controlled_by(secret, instance.uid):
                found.conflicts.append(Conflict.of({**secret, "kind": "Secret"}))
                return
            credentials = RevisionCredentials.generate()
        for built in build_revision_children(
            spec,
            instance,
            revision,
            credentials,
            self.operator_namespace,
            serving=serving,
            metrics=self.metrics,
        ):
            child = with_replicas(built, replicas)
            kind, name = child["kind"], child["metadata"]["name"]
            if kind == "Secret" and secret is not None:
                continue
            if kind == "Secret" and key is not None:
                self._create_unread(found, instance, child)
                continue
            if kind == "ConfigMap" and key is not None:  # the credentials' record (not drift)
                child["metadata"].setdefault("annotations", {})[CREDENTIALS_MARK] = derived_mark(
                    key
                )
            conflicts = len(found.conflicts)
            existing = self._claim(found, instance, child)
            if len(found.conflicts) > conflicts:
                return
            if existing is None or kind == "Secret":
                continue
            patch = drift_patch(child, existing)
            if patch is not None:
                self.kube.patch(child["apiVersion"], kind, ns, name, patch)

    def _fence_routers(self, instance: Instance, keep: Sequence[str], open_: set[str]) -> None:
        """Open the routers of the revision the stable Service is about to select (before the
        switch, so no client meets a closed router) and of those draining after a switch;
        close every other kept revision's (a candidate's, until its promotion)."""
        ns = instance.namespace
        for revision in keep:
            policy = build_router_network_policy(
                instance, revision, self.operator_namespace, revision in open_, self.metrics
            )
            name = policy["metadata"]["name"]
            existing = self._ours(
                instance, self.kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, name)
            )
            patch = drift_patch(policy, existing) if existing is not None else None
            if patch is not None:
                self.kube.patch("networking.k8s.io/v1", "NetworkPolicy", ns, name, patch)

    def _rerun_canary(self, instance: Instance, revision: str, wanted: str) -> list[Event]:
        """Delete the revision's canary Job (its pods with it) when the InferenceDeployment's
        kvfence.dev/rerun-canary differs from the value the Job ran with; this pass then
        starts a fresh one once the revision is ready (canary_rerun)."""
        name = canary_job_name(instance, revision)
        job = self._ours(instance, self.kube.get("batch/v1", "Job", instance.namespace, name))
        if job is None or not rerun_requested(job, wanted):
            return []
        self.kube.delete("batch/v1", "Job", instance.namespace, name)
        return [
            Event(
                "Normal",
                "CanaryRerun",
                f"{ANNOTATION_RERUN_CANARY}={wanted!r}: the canary of revision {revision} "
                "runs again",
            )
        ]

    def _serve(
        self, found: Findings, spec: InferenceDeploymentSpec, instance: Instance, revision: str
    ) -> bool:
        """Make the stable Service what the spec declares, pointed at `revision`. False when
        the name is someone else's Service (left untouched; a NameConflict)."""
        service = build_stable_service(spec, instance, revision)
        existing = self._claim(found, instance, service)
        if existing is None:
            return False
        patch = stable_service_patch(existing, service)
        if patch is not None:
            self.kube.patch("v1", "Service", instance.namespace, instance.name, patch)
        return True

    def _secret_exists(self, namespace: str, name: str) -> bool:
        """Whether a Secret exists, without reading it: a dry-run create answers 409 when the
        name is taken and stores nothing when not. Another refusal (a quota's 403) leaves the
        question open: not reported missing."""
        probe = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
        }
        try:
            return not self.kube.create(probe, dry_run=True)
        except KubeError:
            return True

    def _create_unread(self, found: Findings, instance: Instance, secret: dict[str, Any]) -> None:
        """A derived revision Secret: created; a 409 says it exists (its content is the same
        derivation). A name someone else took is not detected here: that Secret's token is
        not the derived one, so the engines answer the operator's pool probe with 401 and no
        pod passes the gate (fail closed, PoolUnknown)."""
        if self.owner_deleted(instance.uid):
            return
        try:
            self.kube.create(secret)
        except KubeError as exc:  # forbidden (quota), rejected: said, and the pass goes on
            found.problems.append(create_problem("Secret", secret["metadata"]["name"], exc))

    def _internal_token(self, instance: Instance, revision: str) -> str | None:
        """The revision's internal token: derived when its router ConfigMap records this
        operator's credentials key; read from its Secret otherwise (a revision made by an
        older operator, or under another key: RBAC `get`, chart rbac.legacyRevisionSecrets)."""
        ns = instance.namespace
        if self.credentials_key is not None:
            name = child_name(instance, revision, Role.ROUTER)
            configmap = self._ours(instance, self.kube.get("v1", "ConfigMap", ns, name))
            annotations = ((configmap or {}).get("metadata") or {}).get("annotations") or {}
            if annotations.get(CREDENTIALS_MARK) == derived_mark(self.credentials_key):
                key = self.credentials_key
                return RevisionCredentials.derive(key, instance, revision).internal_token
        name = secret_name(instance, revision)
        try:
            secret = self.kube.get("v1", "Secret", ns, name)
        except KubeError as exc:
            if exc.status == 403:
                raise CredentialsUnreadable(revision, name) from exc
            raise
        return internal_token_of(self._ours(instance, secret))

    def _retire(self, instance: Instance, keep: set[str]) -> None:
        retired: set[str] = set()
        derived: set[str] = set()  # their Secrets were created, never read, by this operator
        for api_version, kind in REVISION_KINDS:
            for obj in self.kube.list(api_version, kind, instance.namespace, selector(instance)):
                if not controlled_by(obj, instance.uid):
                    continue  # labelled like ours, but someone else's: never deleted
                revision = (obj["metadata"].get("labels") or {}).get(LABEL_REVISION)
                if revision is not None and revision not in keep:
                    retired.add(revision)
                    annotations = obj["metadata"].get("annotations") or {}
                    if self.credentials_key is not None and annotations.get(
                        CREDENTIALS_MARK
                    ) == derived_mark(self.credentials_key):
                        derived.add(revision)
                    self.kube.delete(api_version, kind, instance.namespace, obj["metadata"]["name"])
        for revision in retired:
            name = secret_name(instance, revision)
            if revision in derived:
                self.kube.delete("v1", "Secret", instance.namespace, name)
                continue
            try:  # an older operator's: deleted only if ours, which takes reading it
                secret = self.kube.get("v1", "Secret", instance.namespace, name)
            except KubeError as exc:
                if exc.status != 403:
                    raise
                continue  # no `get`: it goes with the InferenceDeployment (ownerReference)
            if self._ours(instance, secret):
                self.kube.delete("v1", "Secret", instance.namespace, name)

    # ---- observation ---------------------------------------------------------------------

    def _spec_record(self, instance: Instance, revision: str) -> str | None:
        """The spec recorded on the revision's router ConfigMap (revision.judged_spec)."""
        name = child_name(instance, revision, Role.ROUTER)
        configmap = self.kube.get("v1", "ConfigMap", instance.namespace, name)
        annotations = ((configmap or {}).get("metadata") or {}).get("annotations") or {}
        return annotations.get(ANNOTATION_SPEC)

    def _observe(
        self, found: Findings, spec: InferenceDeploymentSpec, instance: Instance, revision: str
    ) -> tuple[RevisionObservation, list[PodPool], list[Event]]:
        """`spec`: the one this revision is judged by (revision.judged_spec)."""
        ns = instance.namespace
        pods: list[dict[str, Any]] = []
        # the engines require the revision's token on /v1/kvpool
        token = self._internal_token(instance, revision)
        deployments = {
            role: self._ours(
                instance,
                self.kube.get("apps/v1", "Deployment", ns, child_name(instance, revision, role)),
            )
            for role in (*ENGINE_ROLES, Role.ROUTER)
        }
        probes: list[Probe] = []
        for role in ENGINE_ROLES:
            for pod in self._revision_pods(
                ns, deployments[role], selector(instance, revision, role)
            ):
                if not may_serve(pod):  # deleted, evicted or finished
                    continue
                pods.append(pod)
                probes.append(
                    Probe(
                        pod["metadata"]["name"],
                        str(role),
                        revision,
                        pod_url(pod),
                        token,
                        container_instance(pod),
                    )
                )
        pools = self._pools(probes)
        decision = judge_pools(
            pools,
            spec.pool_policy,
            spec.context_length,
            spec.min_context_length,
            unsafe_faults_allowed=self.unsafe_faults_allowed,
            pool_share=spec.tenant_limits.max_pool_share_per_tenant,
        )
        events = [
            event
            for pod in pods
            if (event := self._set_gate(ns, pod, decision.gates[pod["metadata"]["name"]]))
        ]
        urls: dict[str, list[str]] = {str(role): [] for role in ENGINE_ROLES}
        for pod, pool in zip(pods, pools, strict=True):
            url = pod_url(pod)
            if decision.gates[pool.pod].sufficient and url is not None:  # pods: may_serve
                urls[pool.role].append(url)
        backends = self._write_backends(
            found, spec, instance, revision, decision.effective_context, urls
        )
        routers = self._revision_pods(
            ns, deployments[Role.ROUTER], selector(instance, revision, Role.ROUTER)
        )
        self.push_backends(
            [url for pod in routers if may_serve(pod) and (url := pod_url(pod))], backends, token
        )

        replicas = {}
        for role, deployment in deployments.items():
            replicas[str(role)] = RoleReplicas(
                ready=int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0),
                desired=int(((deployment or {}).get("spec") or {}).get("replicas") or 0),
            )
        job = self._ours(
            instance, self.kube.get("batch/v1", "Job", ns, canary_job_name(instance, revision))
        )
        canary = None
        if job is not None:
            job_pods = [
                pod
                for pod in self.kube.list(
                    "v1", "Pod", ns, selector(instance, revision, Role.CANARY)
                )
                if controlled_by(pod, job["metadata"]["uid"])
            ]
            canary = canary_outcome(job, job_pods)
        observation = RevisionObservation(revision, replicas, decision, canary)
        return observation, pools, events

    def _pools(self, probes: Sequence[Probe]) -> list[PodPool]:
        """Each pod's pool: from the prober (read once per container instance, off the pass)
        when there is one, else read now."""
        if self.prober is not None:
            return self.prober.pools(probes)
        return [self.read_pool(p.pod, p.role, p.revision, p.url, p.token) for p in probes]

    def _revision_pods(
        self, namespace: str, deployment: Mapping[str, Any] | None, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        """The pods `deployment` controls, among those carrying its labels: a pod someone
        else labelled like an engine is never probed, gated or given the internal token."""
        if deployment is None:
            return []
        replicasets: dict[str, dict[str, Any] | None] = {}

        def replicaset(name: str) -> dict[str, Any] | None:
            if name not in replicasets:
                replicasets[name] = self.kube.get("apps/v1", "ReplicaSet", namespace, name)
            return replicasets[name]

        return [
            pod
            for pod in self.kube.list("v1", "Pod", namespace, labels)
            if pod_controlled_by_deployment(pod, deployment, replicaset)
        ]

    def _set_gate(self, namespace: str, pod: dict[str, Any], gate: PodGate) -> Event | None:
        """Set the pod's kvfence.dev/kv-pool condition when it changed, with an Event when its
        status flips. The kubelet writes the same conditions list, so the write is guarded by
        resourceVersion; on a conflict the pod is read again and the write retried."""
        name = pod["metadata"]["name"]
        old = pod_condition(pod, KV_POOL_GATE)
        for _ in range(GATE_WRITE_ATTEMPTS):
            patch = gate_patch(pod, gate)
            if patch is None:
                return None
            try:
                self.kube.patch("v1", "Pod", namespace, name, patch, subresource="status")
                break
            except KubeError as exc:
                if exc.status != 409:
                    raise
                fresh = self.kube.get("v1", "Pod", namespace, name)
                if fresh is None:
                    return None
                pod = fresh
        else:
            return None  # still contended: the next pass writes it
        flipped = old is None or old.get("status") != ("True" if gate.sufficient else "False")
        if not flipped:
            return None
        return Event("Normal" if gate.sufficient else "Warning", gate.reason, gate.message)

    def _write_backends(
        self,
        found: Findings,
        spec: InferenceDeploymentSpec,
        instance: Instance,
        revision: str,
        context: int | None,
        urls: Mapping[str, list[str]],
    ) -> BackendsFile:
        """Write the router's ConfigMap (its start-up source) and return what it holds, with
        the version router_push.versioned gives it."""
        name = child_name(instance, revision, Role.ROUTER)
        held = self._ours(instance, self.kube.get("v1", "ConfigMap", instance.namespace, name))
        written = written_backends(((held or {}).get("data") or {}).get(BACKENDS_FILE_NAME))
        prefill, decode = urls[str(Role.PREFILL)], urls[str(Role.DECODE)]
        backends = versioned(
            router_backends(spec, revision, context, prefill, decode), written, now_ms()
        )
        configmap = build_router_configmap(
            spec,
            instance,
            revision,
            context_length=context,
            prefill_urls=prefill,
            decode_urls=decode,
            version=backends.version,
        )
        existing = self._claim(found, instance, configmap)
        wanted = {
            "metadata": {"annotations": configmap["metadata"]["annotations"]},
            "data": configmap["data"],
        }
        if existing is not None and not is_subset(wanted, existing):
            self.kube.patch("v1", "ConfigMap", instance.namespace, name, wanted)
        return backends


def _condition_message(status: InferenceDeploymentStatus, reason: str) -> str | None:
    """The Degraded condition's message when it has this reason (an Event is sent when a
    NameConflict first appears or changes, not on every pass)."""
    degraded = next((c for c in status.conditions if c.type == ConditionType.DEGRADED), None)
    return degraded.message if degraded is not None and degraded.reason == reason else None


def _degraded(status: InferenceDeploymentStatus) -> tuple[str, str] | None:
    """Degraded's reason and message: an Event goes out when an error first appears or its
    message changes, not on every pass."""
    degraded = next((c for c in status.conditions if c.type == ConditionType.DEGRADED), None)
    return (degraded.reason, degraded.message) if degraded is not None else None
