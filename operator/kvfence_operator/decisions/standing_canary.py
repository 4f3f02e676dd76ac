"""The standing canary: the rollout's canary, run again against the serving revision on
spec.canary.schedule, so that isolation that breaks after a rollout (a node's memory, a driver,
an engine that goes wrong) is seen by the operator before a tenant sees it.

Why the operator's timer and not a CronJob: the operator must read every run's verdict anyway
(IsolationVerified, Events, the metric, the exposure window), it already builds, checks
(decisions/canary.py::job_mismatch) and reads canary Jobs, and a CronJob would be one more
object anyone with `edit` could change to run something else under the canary's name. The
schedule lives in status (nextRunTime), so a restarted operator keeps it.

Per pass, pure:
- the run in progress (status.standingCanary.lastRun) gets its verdict once its Job ends: a
  Job that is not the one the operator builds, or that vanished, has none (CouldNotRun);
- when nextRunTime has come, a run starts, unless one is still going: that one is skipped (a
  CronJob's concurrencyPolicy Forbid), and nextRunTime moves on either way. Never in the pass
  that records a verdict, though: that pass's status shows it in lastRun (and the metric counts
  it there), and the next pass starts the run that is due;
- a failure records its exposure window: from the start of the last run that passed (before
  any, the rollout canary's Job's start, else when the watch began) to the verdict;
- IsolationVerified says the latest verdict; finished Jobs beyond the newest HISTORY are
  deleted, except the last failure's, which is its evidence.
A new serving revision starts a new watch: its status says nothing of another revision.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from kvfence_engine.contracts import TenantRequests
from kvfence_operator.builders.canary_job import (
    build_standing_job,
    standing_job_name,
    standing_job_prefix,
)
from kvfence_operator.builders.secret import CANARY_TENANTS
from kvfence_operator.crd.schedule import parse as parse_schedule
from kvfence_operator.crd.types import (
    CanaryFailureAction,
    CanaryResult,
    ConditionReason,
    ConditionStatus,
    EventReason,
    InferenceDeploymentSpec,
    StandingCanaryStatus,
    StandingFailure,
    StandingRun,
)
from kvfence_operator.decisions.canary import (
    CanaryOutcome,
    JobPhase,
    job_context_length,
    job_mismatch,
)
from kvfence_operator.decisions.pool_gate import PodGate
from kvfence_operator.decisions.rollout import Event
from kvfence_operator.meta import Instance

QUARANTINE = CanaryFailureAction.QUARANTINE
HISTORY = 3  # finished standing Jobs kept, the newest (and the last failure's)
VERDICTS = {
    JobPhase.SUCCEEDED: CanaryResult.PASSED,
    JobPhase.FAILED: CanaryResult.FAILED,
    JobPhase.COULD_NOT_RUN: CanaryResult.COULD_NOT_RUN,
}


@dataclass(frozen=True, slots=True)
class StandingJob:
    """A standing canary Job of the serving revision (ours), with its verdict so far."""

    job: Mapping[str, Any]
    outcome: CanaryOutcome

    @property
    def name(self) -> str:
        return str(self.job["metadata"]["name"])


@dataclass(frozen=True, slots=True)
class EnginePod:
    """An engine pod of the serving revision that may serve: its name and its URL, as the
    routers' backends name it (pods.pod_url)."""

    name: str
    url: str | None


@dataclass(frozen=True, slots=True)
class IsolationVerdict:
    """The IsolationVerified condition."""

    status: ConditionStatus
    reason: ConditionReason
    message: str


@dataclass(frozen=True, slots=True)
class StandingPlan:
    status: StandingCanaryStatus | None = None
    create: dict[str, Any] | None = None  # the Job of a run that starts now
    delete: tuple[str, ...] = ()  # finished Jobs past the history
    events: tuple[Event, ...] = ()
    condition: IsolationVerdict | None = None
    # a failure recorded this pass: ask the serving revision's routers whom they answered in
    # its window (unix seconds), then with_exposure
    exposure: tuple[float, float] | None = None


def plan_standing(
    spec: InferenceDeploymentSpec,
    instance: Instance,
    serving: str | None,
    context_length: int | None,
    previous: StandingCanaryStatus | None,
    jobs: Sequence[StandingJob],
    rollout_canary_started: datetime | None,
    now: datetime,
    engine_pods: Sequence[EnginePod] = (),
) -> StandingPlan:
    """`serving`: the revision the stable Service selects (None: none yet); `context_length`:
    the context it serves (None: its pools are not known yet, so no run starts);
    `rollout_canary_started`: its rollout canary Job's start, if that Job is still there;
    `engine_pods`: its engine pods, which a failure may quarantine."""
    text = spec.canary.schedule
    if text is None or serving is None:
        return StandingPlan()
    schedule = parse_schedule(text)
    now = now.astimezone(UTC).replace(microsecond=0)
    status = previous if previous is not None and previous.revision == serving else None
    if status is None:
        status = StandingCanaryStatus(
            revision=serving,
            schedule=text,
            next_run_time=schedule.next_after(now),
            last_passed_time=rollout_canary_started or now,
        )
    elif status.schedule != text or status.next_run_time is None:
        status = replace_status(status, schedule=text, next_run_time=schedule.next_after(now))
    events: list[Event] = []
    exposure = None  # the window of a failure recorded this pass
    # quarantined pods stay out until they are deleted
    live = {pod.name for pod in engine_pods}
    if status.quarantined and not live.issuperset(status.quarantined):
        kept = [name for name in status.quarantined if name in live]
        status = replace_status(status, quarantined=kept or None)

    # the run in progress: its verdict, once its Job has ended
    run = status.last_run
    ended = None
    if run is not None and run.result is CanaryResult.RUNNING:
        ended = _verdict(spec, instance, serving, context_length, run, jobs)
        if ended is not None:
            result, message, implicated = ended
            run = run.model_copy(update={"result": result, "message": message})
            status = replace_status(status, last_run=run)
            if result is CanaryResult.PASSED:
                status = replace_status(
                    status, last_passed_job=run.job, last_passed_time=run.start_time
                )
            elif result is CanaryResult.FAILED:
                failure = StandingFailure(
                    job=run.job, time=now, message=message, exposure_since=status.last_passed_time
                )
                status = replace_status(status, last_failure=failure)
                if failure.exposure_since is not None:
                    exposure = (failure.exposure_since.timestamp(), now.timestamp())
            events.append(_verdict_event(status))
            if result is CanaryResult.FAILED and spec.canary.on_failure is QUARANTINE:
                status, event = _quarantine(status, engine_pods, implicated)
                events.append(event)

    # a run due now (the next pass, if this one recorded a verdict)
    create = None
    assert status.next_run_time is not None
    if now >= status.next_run_time and ended is None:
        running = run is not None and run.result is CanaryResult.RUNNING
        if not running and context_length is not None:
            name = standing_job_name(instance, serving, int(now.timestamp()))
            create = build_standing_job(spec, instance, serving, context_length, name)
            run = StandingRun(job=name, start_time=now, result=CanaryResult.RUNNING)
            status = replace_status(status, last_run=run)
        if running or create is not None:  # skipped while one runs; waits for the pools
            status = replace_status(status, next_run_time=schedule.next_after(now))

    return StandingPlan(
        status,
        create,
        _past_history(jobs, status),
        tuple(events),
        isolation_verdict(status),
        exposure,
    )


def with_exposure(
    plan: StandingPlan, reads: Sequence[tuple[str, TenantRequests | str]]
) -> tuple[StandingPlan, tuple[Event, ...]]:
    """The failure of `plan` with whom the routers answered in its window (`reads`: each
    router's URL and its answer, or why there is none), in status; and the Warning Event that
    names them (the pass's other events went out with the plan's decisions)."""
    status = plan.status
    if plan.exposure is None or status is None or status.last_failure is None:
        return plan, ()
    since, until = plan.exposure
    tenants: dict[str, int] = {}
    gaps = []
    for url, read in reads:
        if isinstance(read, str):
            gaps.append(f"router {url} could not be read: {read}")
            continue
        for tenant, count in read.tenants.items():
            if tenant not in CANARY_TENANTS:
                tenants[tenant] = tenants.get(tenant, 0) + count
        if read.covered_since > since:
            gaps.append(f"router {url} knows only from {_time(_utc(read.covered_since))} on")
    read_ok = sum(1 for _, read in reads if not isinstance(read, str))
    note = f"{read_ok} of {len(reads)} routers read" + "".join(f"; {gap}" for gap in gaps)
    failure = status.last_failure.model_copy(update={"tenants": tenants, "tenants_read": note})
    said = ", ".join(f"{t} ({n})" for t, n in sorted(tenants.items(), key=lambda i: -i[1]))
    event = Event(
        "Warning",
        EventReason.EXPOSED_TENANTS,
        f"revision {status.revision}'s routers answered these tenants between "
        f"{_time(_utc(since))} and {_time(_utc(until))}, the window of standing canary "
        f"{failure.job}'s failure: {said or 'none'} ({note})",
    )
    told = replace(plan, status=replace_status(status, last_failure=failure), exposure=None)
    return told, (event,)


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def replace_status(status: StandingCanaryStatus, **changes: Any) -> StandingCanaryStatus:
    return status.model_copy(update=changes)


def _verdict(
    spec: InferenceDeploymentSpec,
    instance: Instance,
    serving: str,
    context_length: int | None,
    run: StandingRun,
    jobs: Sequence[StandingJob],
) -> tuple[CanaryResult, str, tuple[str, ...]] | None:
    """The run's verdict, the canary's summary and the backends it implicates, once its Job
    ended; None while it runs."""
    job = next((j for j in jobs if j.name == run.job), None)
    if job is None:
        return CanaryResult.COULD_NOT_RUN, f"its Job {run.job} was deleted before it ended", ()
    result = VERDICTS.get(job.outcome.phase)
    if result is None:
        return None
    # Only the Job the operator builds has a verdict: anyone who may create Jobs can give
    # one the run's name and owner. Built from today's spec with the context the Job records,
    # so a change of spec.canary while it ran makes it say nothing rather than pass.
    context = job_context_length(job.job) or context_length or spec.context_length
    built = build_standing_job(spec, instance, serving, context, run.job)
    mismatch = job_mismatch(job.job, built)
    if mismatch is not None:
        return (
            CanaryResult.COULD_NOT_RUN,
            f"Job {run.job} is not the one the operator built ({mismatch}; spec.canary changed "
            "while it ran, or someone else made it)",
            (),
        )
    return result, job.outcome.message or str(job.outcome.phase), job.outcome.implicated


def _quarantine(
    status: StandingCanaryStatus, pods: Sequence[EnginePod], implicated: Sequence[str]
) -> tuple[StandingCanaryStatus, Event]:
    """The pods the failed run implicates (its engine counters rose there), else every engine
    pod of the revision: a leak the canary saw but could not place is trusted to no pod."""
    named = [pod.name for pod in pods if pod.url is not None and pod.url in implicated]
    chosen = named or [pod.name for pod in pods]
    why = (
        f"their isolation counters rose during the run ({', '.join(implicated)})"
        if named
        else "the run named no engine (every engine pod of the revision)"
    )
    quarantined = sorted({*(status.quarantined or []), *chosen})
    failure = status.last_failure
    assert failure is not None
    event = Event(
        "Warning",
        EventReason.QUARANTINED,
        f"{', '.join(chosen) or 'no engine pod'} left the routers (kv-pool gate False): "
        f"standing canary {failure.job} failed and {why}; kept for inspection until you delete "
        "them (spec.canary.onFailure Quarantine)",
    )
    return replace_status(status, quarantined=quarantined or None), event


def quarantine_gate(pod: str) -> PodGate:
    """The kv-pool gate of a quarantined pod: closed, whatever its pool."""
    return PodGate(
        pod,
        False,
        ConditionReason.QUARANTINED,
        "a failed standing canary run quarantined this pod (status.standingCanary); delete it "
        "once inspected and its ReplicaSet starts a fresh one",
    )


def _verdict_event(status: StandingCanaryStatus) -> Event:
    """One Event per finished run: a failure and a run without a verdict are Warnings."""
    run = status.last_run
    assert run is not None
    if run.result is CanaryResult.FAILED:
        return Event("Warning", EventReason.STANDING_CANARY_FAILED, _failed(status))
    if run.result is CanaryResult.COULD_NOT_RUN:
        return Event(
            "Warning",
            EventReason.STANDING_CANARY_COULD_NOT_RUN,
            f"standing canary {run.job} could not run: {run.message} (no verdict: isolation "
            "is not known to hold)",
        )
    return Event(
        "Normal",
        EventReason.STANDING_CANARY_PASSED,
        f"standing canary {run.job} passed: {run.message}",
    )


def _failed(status: StandingCanaryStatus) -> str:
    failure = status.last_failure
    assert failure is not None
    since = failure.exposure_since
    window = (
        f"tenants' requests from {_time(since)} (the last run that passed) to "
        f"{_time(failure.time)} may have been exposed"
        if since is not None
        else f"no run had passed before; exposed until {_time(failure.time)}"
    )
    return (
        f"standing canary {failure.job} failed on revision {status.revision}: "
        f"{failure.message}; {window}"
    )


def isolation_verdict(status: StandingCanaryStatus) -> IsolationVerdict:
    """IsolationVerified: False from a failure until a run passes after it (a run that could
    not run does not clear it); Unknown after a run that could not run; True otherwise."""
    run = status.last_run
    failure = status.last_failure
    passed = status.last_passed_time
    nxt = f"; next run at {_time(status.next_run_time)}" if status.next_run_time else ""
    if failure is not None and (passed is None or passed < failure.time):
        return IsolationVerdict(
            ConditionStatus.FALSE, ConditionReason.STANDING_CANARY_FAILED, _failed(status) + nxt
        )
    if run is not None and run.result is CanaryResult.COULD_NOT_RUN:
        return IsolationVerdict(
            ConditionStatus.UNKNOWN,
            ConditionReason.STANDING_CANARY_COULD_NOT_RUN,
            f"standing canary {run.job} could not run: {run.message}{nxt}",
        )
    if status.last_passed_job is None:
        return IsolationVerdict(
            ConditionStatus.TRUE,
            ConditionReason.CANARY_PASSED,
            f"revision {status.revision} passed its rollout canary; the standing canary has "
            f"not finished a run yet{nxt}",
        )
    earlier = f"; the last failure: {failure.job} at {_time(failure.time)}" if failure else ""
    return IsolationVerdict(
        ConditionStatus.TRUE,
        ConditionReason.STANDING_CANARY_PASSED,
        f"standing canary {status.last_passed_job} (started {_time(passed)}) passed{earlier}{nxt}",
    )


def _past_history(jobs: Sequence[StandingJob], status: StandingCanaryStatus) -> tuple[str, ...]:
    """Finished Jobs beyond the newest HISTORY, but never the run in progress or the last
    failure's."""
    keep = {status.last_run.job if status.last_run else None}
    keep.add(status.last_failure.job if status.last_failure else None)
    finished = sorted(
        (j for j in jobs if j.outcome.phase is not JobPhase.RUNNING and j.name not in keep),
        key=lambda j: str(j.job["metadata"].get("creationTimestamp") or ""),
    )
    room = max(0, HISTORY - sum(1 for k in keep if k is not None))
    return tuple(j.name for j in finished[: max(0, len(finished) - room)])


def is_standing_job(name: str, instance: Instance, revision: str) -> bool:
    return name.startswith(standing_job_prefix(instance, revision))


def _time(moment: datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
