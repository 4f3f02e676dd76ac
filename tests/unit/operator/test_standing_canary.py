"""The standing canary's decisions (decisions/standing_canary.py), pass by pass: when a run
starts, what its verdict makes of IsolationVerified and the exposure window, which Jobs go, and
that only the Job the operator built has a verdict."""

import copy
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvfence_engine.contracts import TenantRequests
from kvfence_operator.app.metrics import new_verdicts
from kvfence_operator.builders.canary_job import build_standing_job
from kvfence_operator.crd.schedule import parse as parse_schedule
from kvfence_operator.crd.types import (
    CanaryResult,
    ConditionReason,
    ConditionStatus,
    EventReason,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    StandingCanaryStatus,
)
from kvfence_operator.decisions.canary import CanaryOutcome, JobPhase
from kvfence_operator.decisions.standing_canary import (
    HISTORY,
    EnginePod,
    StandingJob,
    StandingPlan,
    plan_standing,
    quarantine_gate,
    with_exposure,
)
from kvfence_operator.meta import Instance

INSTANCE = Instance(name="tiny", namespace="team", uid="uid-tiny")
REVISION = "r1"
CONTEXT = 512
START = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
ROLLOUT_CANARY = START - timedelta(minutes=3)
FINDING = "FAIL engine_counters: tag-mismatch rose on #2 (0 -> 3)"


def spec(schedule: str | None = "@every 60s", **canary: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"source": "builtin:tiny-random"},
            "contextLength": CONTEXT,
            "router": {"apiKeysSecret": "k"},
            "canary": {"schedule": schedule, **canary},
        }
    )


class Watch:
    """One InferenceDeployment's standing canary, pass after pass: the status each pass
    leaves is the next pass's previous, and the Jobs it creates are the next pass's Jobs."""

    def __init__(self, spec_: InferenceDeploymentSpec | None = None) -> None:
        self.spec = spec_ or spec()
        self.status: StandingCanaryStatus | None = None
        self.jobs: dict[str, StandingJob] = {}
        self.plans: list[StandingPlan] = []

    pods: tuple[EnginePod, ...] = (
        EnginePod("tiny-r1-prefill-a", "http://10.0.0.1:8000"),
        EnginePod("tiny-r1-decode-b", "http://10.0.0.2:8000"),
        EnginePod("tiny-r1-decode-c", "http://10.0.0.3:8000"),
    )

    def at(
        self, seconds: float, serving: str = REVISION, context: int | None = CONTEXT
    ) -> StandingPlan:
        plan = plan_standing(
            self.spec,
            INSTANCE,
            serving,
            context,
            self.status,
            list(self.jobs.values()),
            ROLLOUT_CANARY,
            START + timedelta(seconds=seconds),
            self.pods,
        )
        self.status = plan.status
        if plan.create is not None:
            job = copy.deepcopy(plan.create)
            job["metadata"]["uid"] = f"uid-{job['metadata']['name']}"
            job["metadata"]["creationTimestamp"] = f"{seconds:08.0f}"
            self.jobs[job["metadata"]["name"]] = StandingJob(
                job, CanaryOutcome(job["metadata"]["name"], JobPhase.RUNNING)
            )
        for name in plan.delete:
            del self.jobs[name]
        self.plans.append(plan)
        return plan

    def end(self, phase: JobPhase, message: str = "", implicated: tuple[str, ...] = ()) -> str:
        """The run in progress ends."""
        assert self.status is not None and self.status.last_run is not None
        name = self.status.last_run.job
        job = self.jobs[name]
        outcome = CanaryOutcome(name, phase, message, implicated=implicated)
        self.jobs[name] = StandingJob(job.job, outcome)
        return name

    def condition(self) -> tuple[ConditionStatus, ConditionReason]:
        assert self.plans[-1].condition is not None
        return self.plans[-1].condition.status, self.plans[-1].condition.reason


def events(plans: Sequence[StandingPlan]) -> list[tuple[str, str]]:
    return [(e.type, str(e.reason)) for plan in plans for e in plan.events]


def test_without_a_schedule_nothing_watches() -> None:
    plan = Watch(spec(None)).at(0)
    assert plan == StandingPlan()


def test_the_first_run_waits_one_interval_and_runs_against_the_stable_service() -> None:
    watch = Watch()
    first = watch.at(0)
    assert first.create is None
    assert first.status is not None and first.status.next_run_time == START + timedelta(seconds=60)
    # before any run: verified by the rollout's canary, exposure counted from its start
    assert first.status.last_passed_time == ROLLOUT_CANARY
    assert watch.condition() == (ConditionStatus.TRUE, ConditionReason.CANARY_PASSED)
    assert watch.at(59).create is None
    started = watch.at(60)
    assert started.create is not None
    args = started.create["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--target") + 1] == "http://tiny.team.svc:8000"  # what clients reach
    assert args[args.index("--rounds") + 1] == "1"
    assert args[args.index("--max-requests") + 1] == "400"
    assert args[args.index("--rate") + 1] == "2"
    assert started.create["metadata"]["name"].startswith("tiny-r1-watch")
    assert len(started.create["metadata"]["name"]) <= 63  # the job-name label on its pods
    assert started.status is not None and started.status.last_run is not None
    assert started.status.last_run.result is CanaryResult.RUNNING
    assert started.status.next_run_time == START + timedelta(seconds=120)


def test_a_run_still_going_when_the_next_is_due_skips_that_one() -> None:
    watch = Watch()
    watch.at(0)
    watch.at(60)
    skipped = watch.at(125)
    assert skipped.create is None
    assert skipped.status is not None
    assert skipped.status.next_run_time == START + timedelta(seconds=185)
    assert len(watch.jobs) == 1


@pytest.mark.parametrize("phase", [JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.COULD_NOT_RUN])
def test_a_verdict_shows_in_last_run_for_a_pass_before_the_next_run_takes_its_place(
    phase: JobPhase,
) -> None:
    """A run longer than the period: its verdict and the next run fall due in one pass. That
    pass records the verdict (lastRun, the Event, the metric: app/metrics.new_verdicts reads
    it from lastRun), and the next one starts the run that is due, each counted once."""
    watch = Watch()
    watch.at(0)
    first = watch.at(60)
    assert first.status is not None and first.status.last_run is not None
    ran = first.status.last_run.job
    watch.end(phase, "PASS" if phase is JobPhase.SUCCEEDED else FINDING)
    verdict = watch.at(130)  # past the next run's time (120)
    assert verdict.create is None and verdict.status is not None
    assert verdict.status.last_run is not None and verdict.status.last_run.job == ran
    assert verdict.status.last_run.result is not CanaryResult.RUNNING
    assert verdict.status.next_run_time == START + timedelta(seconds=120)  # still due
    started = watch.at(135)
    assert started.create is not None and started.status is not None
    assert started.status.last_run is not None and started.status.last_run.job != ran
    assert started.status.next_run_time == START + timedelta(seconds=195)  # @every: from now
    counted = [
        new_verdicts(_with(before), _with(after))
        for before, after in zip(watch.plans, watch.plans[1:], strict=False)
    ]
    result = {JobPhase.SUCCEEDED: "passed", JobPhase.FAILED: "failed"}
    assert [v for found in counted for v in found] == [
        ("standing", result.get(phase, "could_not_run"))
    ]


def _with(plan: StandingPlan) -> InferenceDeploymentStatus:
    return InferenceDeploymentStatus(standing_canary=plan.status)


def test_a_pass_then_a_failure_names_the_finding_and_the_exposure_window() -> None:
    watch = Watch()
    watch.at(0)
    watch.at(60)
    passed = watch.end(JobPhase.SUCCEEDED, "PASS: all 8 checks passed (96 requests)")
    watch.at(90)
    assert watch.condition() == (ConditionStatus.TRUE, ConditionReason.STANDING_CANARY_PASSED)
    assert watch.status is not None and watch.status.last_passed_job == passed
    assert watch.status.last_passed_time == START + timedelta(seconds=60)
    watch.at(120)
    failed = watch.end(JobPhase.FAILED, FINDING)
    plan = watch.at(150)
    assert watch.condition() == (ConditionStatus.FALSE, ConditionReason.STANDING_CANARY_FAILED)
    assert plan.status is not None and plan.status.last_failure is not None
    assert plan.status.last_failure.job == failed
    # from the start of the run that passed to the failing verdict
    assert plan.status.last_failure.exposure_since == START + timedelta(seconds=60)
    assert plan.status.last_failure.time == START + timedelta(seconds=150)
    (event,) = plan.events
    assert (event.type, event.reason) == ("Warning", EventReason.STANDING_CANARY_FAILED)
    assert FINDING in event.message
    assert "2026-12-07T12:01:00Z" in event.message and "2026-12-07T12:02:30Z" in event.message
    assert plan.condition is not None and FINDING in plan.condition.message


def test_a_failure_stands_until_a_later_run_passes() -> None:
    watch = Watch()
    watch.at(0)
    watch.at(60)
    watch.end(JobPhase.FAILED, FINDING)
    watch.at(70)
    watch.at(120)  # the next run: still False while it runs
    assert watch.condition()[0] is ConditionStatus.FALSE
    watch.end(JobPhase.COULD_NOT_RUN, "could not run: the budget of 400 requests is spent")
    watch.at(130)  # no verdict does not clear a finding
    assert watch.condition() == (ConditionStatus.FALSE, ConditionReason.STANDING_CANARY_FAILED)
    watch.at(180)
    watch.end(JobPhase.SUCCEEDED, "PASS")
    watch.at(190)
    assert watch.condition() == (ConditionStatus.TRUE, ConditionReason.STANDING_CANARY_PASSED)
    assert watch.plans[-1].condition is not None
    assert "the last failure" in watch.plans[-1].condition.message
    assert events(watch.plans) == [
        ("Warning", "StandingCanaryFailed"),
        ("Warning", "StandingCanaryCouldNotRun"),
        ("Normal", "StandingCanaryPassed"),
    ]


def test_a_run_without_a_verdict_makes_isolation_unknown() -> None:
    watch = Watch()
    watch.at(0)
    watch.at(60)
    watch.end(JobPhase.COULD_NOT_RUN, "could not run: lost the target")
    watch.at(70)
    assert watch.condition() == (
        ConditionStatus.UNKNOWN,
        ConditionReason.STANDING_CANARY_COULD_NOT_RUN,
    )


def test_a_job_deleted_while_it_ran_has_no_verdict() -> None:
    watch = Watch()
    watch.at(0)
    watch.at(60)
    watch.jobs.clear()
    watch.at(70)
    assert watch.status is not None and watch.status.last_run is not None
    assert watch.status.last_run.result is CanaryResult.COULD_NOT_RUN
    assert "deleted before it ended" in (watch.status.last_run.message or "")


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda c: c.update(image="attacker/always-pass:1"), id="image"),
        pytest.param(lambda c: c.update(args=["canary", "--help"]), id="args"),
        pytest.param(lambda c: c.update(command=["sh", "-c", "exit 0"]), id="command"),
    ],
)
def test_a_passing_job_the_operator_did_not_build_is_no_verdict(edit: Any) -> None:
    """Anyone who may create Jobs can give one a run's name, labels and owner and let it
    succeed: it opens nothing (negative control: the same Job unedited passes)."""
    watch = Watch()
    watch.at(0)
    watch.at(60)
    assert watch.status is not None and watch.status.last_run is not None
    name = watch.status.last_run.job
    forged = copy.deepcopy(watch.jobs[name].job)
    edit(forged["spec"]["template"]["spec"]["containers"][0])
    watch.jobs[name] = StandingJob(forged, CanaryOutcome(name, JobPhase.SUCCEEDED, "PASS"))
    watch.at(70)
    assert watch.status.last_run.result is CanaryResult.COULD_NOT_RUN
    assert "not the one the operator built" in (watch.status.last_run.message or "")
    assert watch.status.last_passed_job is None


def test_the_job_the_operator_built_passes() -> None:
    watch = Watch()
    watch.at(0)
    watch.at(60)
    watch.end(JobPhase.SUCCEEDED, "PASS")
    watch.at(70)
    assert watch.status is not None and watch.status.last_run is not None
    assert watch.status.last_run.result is CanaryResult.PASSED


def test_finished_jobs_past_the_history_go_but_the_failures_evidence_stays() -> None:
    watch = Watch()
    watch.at(0)
    watch.at(60)
    failed = watch.end(JobPhase.FAILED, FINDING)
    for n in range(2, 8):
        watch.at(60 * n)
        watch.end(JobPhase.SUCCEEDED, "PASS")
        watch.at(60 * n + 10)
    assert failed in watch.jobs
    assert len(watch.jobs) == HISTORY
    newest = sorted(watch.jobs.values(), key=lambda j: j.job["metadata"]["creationTimestamp"])
    assert watch.status is not None and watch.status.last_run is not None
    assert newest[-1].name == watch.status.last_run.job


def test_a_new_serving_revision_starts_a_new_watch() -> None:
    watch = Watch()
    watch.at(0)
    watch.at(60)
    watch.end(JobPhase.FAILED, FINDING)
    watch.at(70)
    plan = watch.at(80, serving="r2")
    assert plan.status is not None and plan.status.revision == "r2"
    assert plan.status.last_failure is None and plan.status.last_run is None
    assert watch.condition() == (ConditionStatus.TRUE, ConditionReason.CANARY_PASSED)


def test_a_changed_schedule_moves_the_next_run() -> None:
    watch = Watch()
    watch.at(0)
    watch.spec = spec("*/30 * * * *")
    plan = watch.at(10)
    assert plan.status is not None
    assert plan.status.next_run_time == datetime(2026, 12, 7, 12, 30, tzinfo=UTC)


def test_a_due_run_waits_for_the_served_context() -> None:
    watch = Watch()
    watch.at(0)
    waiting = watch.at(61, context=None)
    assert waiting.create is None
    assert waiting.status is not None
    assert waiting.status.next_run_time == START + timedelta(seconds=60)
    assert watch.at(62).create is not None


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("@every 5s", "at least @every 10s"),
        ("@every 1d", "@every takes a duration"),
        ("@often", "unknown descriptor"),
        ("61 * * * *", "Bad minute"),
        ("* * *", "Wrong number of fields"),
    ],
)
def test_a_schedule_that_is_not_one_is_refused_with_what_is_wrong(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        spec(text)


def test_descriptors_read_as_a_cronjob_reads_them() -> None:
    at = datetime(2026, 12, 7, 12, 10, tzinfo=UTC)
    assert parse_schedule("@hourly").next_after(at) == datetime(2026, 12, 7, 13, 0, tzinfo=UTC)
    assert parse_schedule("@every 1h30m").next_after(at) == at + timedelta(minutes=90)


def test_the_standing_job_carries_the_spec_load_bounds() -> None:
    job = build_standing_job(
        spec(standingLoad={"maxRequests": 150, "requestsPerSecond": 0.5}),
        INSTANCE,
        REVISION,
        256,
        "tiny-r1-watchx",
    )
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-requests") + 1] == "150"
    assert args[args.index("--rate") + 1] == "0.5"
    assert args[args.index("--context-length") + 1] == "256"


def failed_with(implicated: tuple[str, ...], on_failure: str = "Quarantine") -> Watch:
    watch = Watch(spec(onFailure=on_failure))
    watch.at(0)
    watch.at(60)
    watch.end(JobPhase.FAILED, FINDING, implicated)
    watch.at(70)
    return watch


def test_quarantine_takes_out_the_pods_whose_counters_rose() -> None:
    watch = failed_with(("http://10.0.0.3:8000",))
    assert watch.status is not None and watch.status.quarantined == ["tiny-r1-decode-c"]
    warnings = [e for e in watch.plans[-1].events if e.reason is EventReason.QUARANTINED]
    (event,) = warnings
    assert event.type == "Warning" and "tiny-r1-decode-c" in event.message
    assert "http://10.0.0.3:8000" in event.message


def test_a_leak_the_canary_could_not_place_quarantines_every_engine_pod() -> None:
    watch = failed_with(())
    assert watch.status is not None
    assert watch.status.quarantined == ["tiny-r1-decode-b", "tiny-r1-decode-c", "tiny-r1-prefill-a"]


def test_report_quarantines_nothing() -> None:
    watch = failed_with(("http://10.0.0.3:8000",), on_failure="Report")
    assert watch.status is not None and watch.status.quarantined is None
    assert EventReason.QUARANTINED not in {e.reason for p in watch.plans for e in p.events}


def test_a_quarantined_pod_stays_out_until_it_is_deleted_and_a_pass_does_not_release_it() -> None:
    watch = failed_with(("http://10.0.0.3:8000",))
    watch.at(120)
    watch.end(JobPhase.SUCCEEDED, "PASS")
    watch.at(130)
    assert watch.status is not None and watch.status.quarantined == ["tiny-r1-decode-c"]
    watch.pods = watch.pods[:2]  # deleted: its ReplicaSet starts another
    watch.at(140)
    assert watch.status is not None and watch.status.quarantined is None


def test_the_quarantine_gate_is_closed_with_its_reason() -> None:
    gate = quarantine_gate("tiny-r1-decode-c")
    assert not gate.sufficient and gate.reason is ConditionReason.QUARANTINED
    assert "delete it" in gate.message


def test_a_failure_asks_the_routers_whom_they_answered_in_its_window() -> None:
    watch = Watch()
    watch.at(0)
    watch.at(60)
    watch.end(JobPhase.SUCCEEDED, "PASS")
    watch.at(70)
    assert watch.plans[-1].exposure is None  # a pass asks nothing
    watch.at(120)
    watch.end(JobPhase.FAILED, FINDING)
    plan = watch.at(150)
    since, until = (
        (START + timedelta(seconds=60)).timestamp(),
        (START + timedelta(seconds=150)).timestamp(),
    )
    assert plan.exposure == (since, until)
    reads: list[tuple[str, TenantRequests | str]] = [
        ("http://r1", TenantRequests(since=since, until=until, covered_since=0,
                                     tenants={"team-a": 3, "kvfence-canary-a": 50})),
        ("http://r2", TenantRequests(since=since, until=until, covered_since=since + 30,
                                     tenants={"team-a": 1, "team-b": 2, "kvfence-canary-b": 9})),
        ("http://r3", "unreachable at http://r3 (ConnectError)"),
    ]  # fmt: skip
    told, said = with_exposure(plan, reads)
    assert told.status is not None and told.status.last_failure is not None
    # whom to tell, and how much of the window that accounts for; the canary's own left out
    assert told.status.last_failure.tenants == {"team-a": 4, "team-b": 2}
    note = told.status.last_failure.tenants_read or ""
    assert note.startswith("2 of 3 routers read")
    assert "router http://r3 could not be read" in note
    assert "router http://r2 knows only from 2026-12-07T12:01:30Z on" in note
    (event,) = said
    assert (event.type, event.reason) == ("Warning", EventReason.EXPOSED_TENANTS)
    assert "team-a (4), team-b (2)" in event.message
    assert "2026-12-07T12:01:00Z" in event.message and "2026-12-07T12:02:30Z" in event.message
    assert with_exposure(told, reads) == (told, ())  # asked once
