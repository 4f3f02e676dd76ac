"""What a pass does, decided from what it observed. Pure: the decisions (decisions/) applied to
one pass's observations give the writes it must make (a PassPlan); reconcile/act.py makes them.

Per revision the pass keeps: the spec it is judged by (revision.judged_spec), its pools' verdict
(pool_gate.judge_pools) and with it each engine pod's gate and the routers' backends file. Then
the rollout (rollout.plan_rollout): which revision serves, which canary starts, what is fenced
and what retires. The children of the desired and the serving revision are declared from each
one's own spec, with the object's replica counts (drift.declaring_spec, replicas).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from kvfence_engine.contracts import BackendsFile
from kvfence_operator.builders.canary_job import build_canary_job
from kvfence_operator.builders.engine_deployment import ENGINE_ROLES
from kvfence_operator.builders.router_deployment import (
    build_router_configmap,
    build_stable_service,
    router_backends,
)
from kvfence_operator.builders.secret import derived_mark, serving_seal
from kvfence_operator.cluster.router_push import versioned
from kvfence_operator.crd.types import (
    CanaryStatus,
    EventReason,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    PoolPolicy,
    RevisionStatus,
    Role,
    RoleReplicas,
    StandingCanaryStatus,
)
from kvfence_operator.decisions.autoscaling import PodLoad, Recommendation
from kvfence_operator.decisions.canary import (
    CanaryOutcome,
    JobPhase,
    job_context_length,
    job_mismatch,
    rerun_value,
)
from kvfence_operator.decisions.draining import RolePod
from kvfence_operator.decisions.drift import declaring_spec
from kvfence_operator.decisions.findings import (
    Conflict,
    Problem,
    engine_crash_loop,
    record_refused,
)
from kvfence_operator.decisions.pods import gate_held, may_serve, pod_condition, pod_url
from kvfence_operator.decisions.pool_gate import PodGate, PodPool, judge_pools
from kvfence_operator.decisions.replicas import with_replicas_of
from kvfence_operator.decisions.retirement import Retirement, retirement
from kvfence_operator.decisions.rollout import (
    STOPPED,
    Event,
    RevisionObservation,
    RolloutPlan,
    plan_rollout,
    selected_revision,
)
from kvfence_operator.decisions.scaling import (
    ScalingOutcome,
    ServingRole,
    plan_pass_scaling,
)
from kvfence_operator.decisions.standing_canary import (
    EnginePod,
    StandingPlan,
    plan_standing,
    quarantine_gate,
)
from kvfence_operator.meta import (
    ANNOTATION_DRAINING,
    ANNOTATION_RERUN_CANARY,
    ANNOTATION_SPEC,
    KV_POOL_GATE,
    Instance,
)
from kvfence_operator.reconcile.observe import Frame, RevisionSeen
from kvfence_operator.revision import judged_spec


@dataclass(frozen=True, slots=True)
class Ensure:
    """A revision whose children must exist as declared."""

    revision: str
    spec: InferenceDeploymentSpec  # the revision's own (drift.declaring_spec)
    deployments_spec: InferenceDeploymentSpec  # the same, with the object's replica counts
    serving: bool  # the stable Service selects it: its routers are public
    # False: the engine Deployments' replicas are a user's autoscaler's (External): set at
    # creation, never declared again
    engine_replicas: bool = True


@dataclass(frozen=True, slots=True)
class RevisionWrites:
    """What a pass writes for one revision it observed: its engine pods' gates, its routers'
    backends file (in their ConfigMap, and pushed to each router)."""

    revision: str
    gates: tuple[tuple[dict[str, Any], PodGate], ...]  # (pod as read, its gate)
    configmap: dict[str, Any]  # the router ConfigMap that holds `backends`
    backends: BackendsFile
    routers: tuple[str, ...]  # the URLs of its routers that may serve
    token: str | None


@dataclass(frozen=True, slots=True)
class PassPlan:
    ensure: tuple[Ensure, ...]
    rerun: str | None  # the revision whose canary Job goes: the user asked for a new run
    rerun_value: str
    revisions: tuple[RevisionWrites, ...]
    rollout: RolloutPlan
    observed: Mapping[str, RevisionObservation]
    pools: Sequence[PodPool]  # of the revision the conditions describe (rollout.judged)
    canary_job: dict[str, Any] | None  # to create now
    open_routers: frozenset[str]  # the kept revisions whose routers admit clients
    stable_service: dict[str, Any] | None  # what the stable Service must be (None: untouched)
    retirement: Retirement
    scaling: ScalingOutcome  # the engine roles' counts, drains and the autoscaler's status
    standing: StandingPlan  # the standing canary's run, history and verdict
    problems: tuple[Problem, ...] = ()  # what the pass met in what it observed (Degraded)
    conflicts: tuple[Conflict, ...] = ()  # names taken by what the operator did not build


@dataclass(frozen=True, slots=True)
class PassInputs:
    """What a pass observed, and what it was asked for."""

    spec: InferenceDeploymentSpec
    instance: Instance
    desired: str
    revision_status: RevisionStatus | None  # rollout.serving_revision
    previous: InferenceDeploymentStatus
    frame: Frame
    seen: Mapping[str, RevisionSeen]  # every revision the pass keeps, by revision
    rerun_value: str  # the InferenceDeployment's kvfence.dev/rerun-canary
    # with no serving revision known: the one the stable Service (ours) selects, kept from
    # retirement (never served, promoted or judged by the selector) until one is promoted
    held: str | None = None
    # the autoscaler's recent recommendations (reconcile/history.py)
    history: Mapping[Role, Sequence[Recommendation]] = field(default_factory=dict)


def decide(
    given: PassInputs,
    *,
    now: datetime,
    now_ms: int,
    unsafe_faults_allowed: bool,
    credentials_key: bytes | None,
) -> PassPlan:
    spec, instance, desired = given.spec, given.instance, given.desired
    current = given.revision_status.current if given.revision_status else None
    serving_seen = given.seen.get(current) if current is not None else None
    scaling = plan_pass_scaling(
        spec,
        given.previous.autoscaling,
        _serving_roles(serving_seen) if serving_seen is not None else None,
        given.history,
        now.timestamp(),
    )
    external = scaling.serving.prefill is None and scaling.serving.decode is None
    ensure = []
    for revision in dict.fromkeys(r for r in (desired, current) if r is not None):
        record = None if revision == desired else given.seen[revision].record
        declaring = declaring_spec(revision, desired, spec, record)
        if declaring is not None:
            counts = scaling.serving if revision == current else scaling.candidate
            scaled = with_replicas_of(declaring, spec, counts)
            ensure.append(Ensure(revision, declaring, scaled, revision == current, not external))
    # a candidate's canary only: the serving one's is never re-run
    job = given.seen[desired].canary_job if desired != current else None
    verdict = given.previous.canary
    if verdict is not None and (desired == current or verdict.revision != desired):
        verdict = None  # about another revision: says nothing of the candidate's canary
    ran_with = _ran_with(verdict, job)
    rerun = desired if ran_with is not None and ran_with != given.rerun_value else None
    # the candidate's Job has a verdict only if it is the one the operator builds
    conflicts: list[Conflict] = []
    foreign = None
    if job is not None and rerun is None:
        built = build_canary_job(
            spec, instance, desired, _built_context(job, spec), rerun_value(job)
        )
        if (why := job_mismatch(job, built)) is not None:
            conflicts.append(Conflict.of({**job, "kind": "Job"}, why))
            foreign = CanaryOutcome(
                job["metadata"]["name"], JobPhase.NOT_BUILT_HERE, why, job["metadata"].get("uid")
            )

    observed: dict[str, RevisionObservation] = {}
    pools_of: dict[str, list[PodPool]] = {}
    writes: list[RevisionWrites] = []
    quarantined = _quarantined(given.previous.standing_canary, current)
    problems: list[Problem] = []
    events: list[Event] = []
    for revision, seen in given.seen.items():
        judged = judged_spec(revision, desired, spec, seen.record)
        canary = None if revision == rerun else seen.canary
        if revision == desired and foreign is not None:
            canary = foreign
        # a revision without a record of its own is observed (by the object's spec, for the
        # status alone) but nothing of it is written: its gates and backends stay as they are
        observed[revision], written = _revision(
            judged or spec,
            instance,
            seen,
            canary,
            now_ms,
            unsafe_faults_allowed,
            scaling.draining if revision == current else frozenset(),
            scaling.floors,
            quarantined if revision == current else frozenset(),
        )
        pools_of[revision] = list(seen.pools)
        if (crashing := engine_crash_loop(revision, seen.engine_pods)) is not None:
            problems.append(crashing)
        if judged is None:
            problems.append(record_refused(revision, seen.records_refused))
        else:
            writes.append(written)
            events += _record_repaired(revision, seen.records_refused)

    plan = plan_rollout(
        desired,
        given.revision_status,
        # a rerun forgets the verdict the candidate's canary had
        None if rerun is not None else given.previous.canary,
        observed,
        spec.canary.enabled,
        now=now,
        retire_after_seconds=spec.rollout.retire_after_seconds,
    )
    canary_job = None
    if plan.start_canary is not None:
        context = observed[plan.start_canary].pools.effective_context
        canary_job = build_canary_job(spec, instance, plan.start_canary, context, given.rerun_value)
    open_routers: frozenset[str] = frozenset()
    stable = None
    if plan.serve is not None:
        # open: the revision about to serve, and those draining (their clients finish there)
        open_routers = frozenset({plan.serve, *(r.revision for r in plan.revision.retiring or [])})
        token = given.seen[plan.serve].token
        secret = credentials_key if credentials_key is not None else _encoded(token)
        seal = serving_seal(secret, instance, plan.serve) if secret is not None else None
        stable = build_stable_service(spec, instance, plan.serve, seal)
        events += _selector_drift(given, plan.serve)
    standing = _standing(given, plan.serve, observed, now)
    events += standing.events
    now_quarantined = _quarantined(standing.status, current)
    if current is not None and now_quarantined != quarantined and current in observed:
        # a failure quarantined pods this pass: out of the routers now, not a pass later
        judged = judged_spec(current, desired, spec, given.seen[current].record)
        if judged is not None:
            observed[current], written = _revision(
                judged,
                instance,
                given.seen[current],
                observed[current].canary,
                now_ms,
                unsafe_faults_allowed,
                scaling.draining,
                scaling.floors,
                now_quarantined,
            )
            writes = [written if w.revision == current else w for w in writes]
    mark = derived_mark(credentials_key) if credentials_key is not None else None
    keep = {*plan.keep, *((given.held,) if given.held is not None else ())}
    events += scaling.events
    if events:
        plan = replace(plan, events=[*events, *plan.events])
    return PassPlan(
        tuple(ensure),
        rerun,
        given.rerun_value,
        tuple(writes),
        plan,
        observed,
        pools_of.get(plan.judged, []),
        canary_job,
        open_routers,
        stable,
        retirement(given.frame.children, keep, instance.uid, mark),
        scaling,
        standing,
        tuple(problems),
        tuple(conflicts),
    )


def _quarantined(status: StandingCanaryStatus | None, serving: str | None) -> frozenset[str]:
    """The serving revision's pods a failed standing run quarantined."""
    if status is None or serving is None or status.revision != serving:
        return frozenset()
    return frozenset(status.quarantined or ())


def _standing(
    given: PassInputs,
    serving: str | None,
    observed: Mapping[str, RevisionObservation],
    now: datetime,
) -> StandingPlan:
    """The standing canary's part of the pass, on the revision that serves after it."""
    seen = given.seen.get(serving) if serving is not None else None
    if seen is None or serving is None:
        return plan_standing(given.spec, given.instance, None, None, None, (), None, now)
    job_status = (seen.canary_job or {}).get("status") or {}
    started = job_status.get("startTime")
    return plan_standing(
        given.spec,
        given.instance,
        serving,
        observed[serving].pools.effective_context,
        given.previous.standing_canary,
        seen.standing,
        datetime.fromisoformat(started) if isinstance(started, str) else None,
        now,
        [EnginePod(pod["metadata"]["name"], pod_url(pod)) for pod in seen.engine_pods],
    )


def _ran_with(verdict: CanaryStatus | None, job: Mapping[str, Any] | None) -> str | None:
    """The kvfence.dev/rerun-canary value the candidate's canary ran with: its verdict's in
    status when it has a verdict that stopped the rollout (its Job may be gone), else its
    Job's; None with neither (nothing ran yet, or a status from before the value was kept
    and no Job: no rerun is inferred)."""
    if verdict is not None and verdict.result in STOPPED and verdict.rerun is not None:
        return verdict.rerun
    return rerun_value(job) if job is not None else None


def _built_context(job: Mapping[str, Any], spec: InferenceDeploymentSpec) -> int:
    """The context a canary Job of this spec may have been built with: the one it records,
    if the spec allows it (its effective context lies between minContextLength, under
    LowerContext, and contextLength); else contextLength, so a Job claiming another fails
    the compare."""
    context = job_context_length(job)
    lowest = spec.context_length
    if spec.pool_policy is PoolPolicy.LOWER_CONTEXT:
        lowest = spec.min_context_length or 1
    if context is None or not lowest <= context <= spec.context_length:
        return spec.context_length
    return context


def _record_repaired(revision: str, refused: Sequence[str]) -> list[Event]:
    if not refused:
        return []
    return [
        Event(
            "Warning",
            EventReason.RECORD_REPAIRED,
            f"the record of revision {revision}'s spec ({ANNOTATION_SPEC}) on "
            f"{', '.join(refused)} was missing or is not revision {revision}'s (it does not "
            "hash to it): refused, and put back from a copy that does",
        )
    ]


def _encoded(token: str | None) -> bytes | None:
    return token.encode() if token is not None else None


def _selector_drift(given: PassInputs, serving: str) -> list[Event]:
    """A Warning when the stable Service (ours) selects another revision than the one status
    says serves and this pass serves: someone else's edit (a promotion this pass makes is
    not drift: the Service selected the revision serving until now)."""
    selected = selected_revision(given.frame.stable, given.instance.uid)
    current = given.revision_status.current if given.revision_status else None
    if selected is None or selected in (serving, current):
        return []
    name = given.instance.name
    return [
        Event(
            "Warning",
            EventReason.SELECTOR_REPAIRED,
            f"Service {name} selected revision {selected}, which does not serve: put back to "
            f"revision {serving} (status.revision.current). Only a candidate whose canary "
            "passed is promoted; a selector edit promotes nothing and retires nothing",
        )
    ]


def _revision(
    spec: InferenceDeploymentSpec,
    instance: Instance,
    seen: RevisionSeen,
    canary: CanaryOutcome | None,
    now_ms: int,
    unsafe_faults_allowed: bool,
    draining: frozenset[str] = frozenset(),
    floors: Mapping[str, int] | None = None,
    quarantined: frozenset[str] = frozenset(),
) -> tuple[RevisionObservation, RevisionWrites]:
    """`spec`: the one this revision is judged by (revision.judged_spec). A pod whose True
    gate this pass cannot judge (pods.gate_held: a new operator's probes still running) keeps
    it, unwritten, and its place in the backends, at the context they were given. Pods
    `draining` (a scale-down: decisions/draining.py) are in no backends file; `floors`: the
    least an autoscaled role serves with (its minReplicas), for whether it is available.
    Pods `quarantined` (a failed standing canary run: decisions/standing_canary.py) get their
    gate False, held or not, and so are in no backends file."""
    held = frozenset(
        pool.pod
        for pod, pool in zip(seen.engine_pods, seen.pools, strict=True)
        if gate_held(pod, pool)
    )
    decision = judge_pools(
        seen.pools,
        spec.pool_policy,
        spec.context_length,
        spec.min_context_length,
        unsafe_faults_allowed=unsafe_faults_allowed,
        pool_share=spec.tenant_limits.max_pool_share_per_tenant,
        held=held,
        held_context=seen.backends.context_length if seen.backends else None,
    )
    if quarantined:
        gates_of = {
            name: quarantine_gate(name) if name in quarantined else gate
            for name, gate in decision.gates.items()
        }
        decision = replace(decision, gates=gates_of)
        held = held - quarantined
    gates = tuple(
        (pod, decision.gates[name])
        for pod in seen.engine_pods
        if (name := pod["metadata"]["name"]) not in held
    )
    urls: dict[str, list[str]] = {str(role): [] for role in ENGINE_ROLES}
    for pod, pool in zip(seen.engine_pods, seen.pools, strict=True):
        url = pod_url(pod)
        if decision.gates[pool.pod].sufficient and url is not None and pool.pod not in draining:
            urls[pool.role].append(url)
    prefill, decode = urls[str(ENGINE_ROLES[0])], urls[str(ENGINE_ROLES[1])]
    context = decision.effective_context
    backends = versioned(
        router_backends(spec, seen.revision, context, prefill, decode), seen.backends, now_ms
    )
    configmap = build_router_configmap(
        spec,
        instance,
        seen.revision,
        context_length=context,
        prefill_urls=prefill,
        decode_urls=decode,
        version=backends.version,
    )
    routers = tuple(url for pod in seen.router_pods if may_serve(pod) and (url := pod_url(pod)))
    replicas = {
        str(role): RoleReplicas(
            ready=int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0),
            desired=int(((deployment or {}).get("spec") or {}).get("replicas") or 0),
        )
        for role, deployment in seen.deployments.items()
    }
    observation = RevisionObservation(seen.revision, replicas, decision, canary, floors or {})
    return observation, RevisionWrites(
        seen.revision, gates, configmap, backends, routers, seen.token
    )


def _serving_roles(seen: RevisionSeen) -> dict[Role, ServingRole]:
    """The serving revision's engine roles, as the autoscaler and the drain read them."""
    loads: Sequence[PodLoad | None] = seen.loads or [None] * len(seen.engine_pods)
    pods: dict[Role, list[RolePod]] = {role: [] for role in ENGINE_ROLES}
    for pod, pool, load in zip(seen.engine_pods, seen.pools, loads, strict=True):
        meta = pod["metadata"]
        gate = pod_condition(pod, KV_POOL_GATE) or {}
        pods[Role(pool.role)].append(
            RolePod(
                pool.pod,
                gate.get("status") == "True",
                _stamp((meta.get("annotations") or {}).get(ANNOTATION_DRAINING)),
                load,
                _stamp(meta.get("creationTimestamp")) or 0.0,
            )
        )
    return {
        role: ServingRole(
            int(d["spec"].get("replicas", 1)) if (d := seen.deployments.get(role)) else None,
            tuple(pods[role]),
        )
        for role in ENGINE_ROLES
    }


def _stamp(value: object) -> float | None:
    """An RFC 3339 time as time.time() would give it; None when absent or not one."""
    try:
        return datetime.fromisoformat(str(value)).timestamp() if value else None
    except ValueError:
        return None


def rerun_event(revision: str, wanted: str) -> Event:
    return Event(
        "Normal",
        EventReason.CANARY_RERUN,
        f"{ANNOTATION_RERUN_CANARY}={wanted!r}: the canary of revision {revision} runs again",
    )
