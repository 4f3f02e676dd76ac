"""The rollout state machine: promotion only after pods, pools and the canary; state in status."""

from datetime import UTC, datetime, timedelta

from helpers.rollout import observation
from kvfence_operator.crd.types import (
    CanaryResult,
    CanaryStatus,
    RetiringRevision,
    RevisionStatus,
)
from kvfence_operator.decisions.rollout import (
    CanaryOutcome,
    JobPhase,
    RolloutPlan,
    plan_rollout,
    serving_revision,
)


def canary_of(plan: RolloutPlan) -> CanaryStatus:
    """The plan's canary status, which every plan here has."""
    assert plan.canary is not None
    return plan.canary


def test_first_revision_waits_for_pods_before_any_canary():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1", ready=0)}, canary_enabled=True)
    assert plan.revision == RevisionStatus(current=None, candidate="r1")
    assert plan.start_canary is None and plan.serve is None
    assert plan.keep == ("r1",)
    assert canary_of(plan).result is CanaryResult.PENDING


def test_a_ready_candidate_with_enough_pool_starts_its_canary_once():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1")}, canary_enabled=True)
    assert plan.start_canary == "r1"
    assert canary_of(plan).result is CanaryResult.RUNNING
    running = CanaryOutcome("job-r1", JobPhase.RUNNING)
    again = plan_rollout(
        "r1", plan.revision, plan.canary, {"r1": observation("r1", canary=running)}, True
    )
    assert again.start_canary is None and again.serve is None


def test_a_pool_too_small_never_reaches_the_canary():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1", pool_tokens=256)}, True)
    assert plan.start_canary is None and plan.serve is None


def test_a_passed_canary_promotes_and_retires_the_old_revision():
    previous = RevisionStatus(current="r1", candidate="r2")
    passed = CanaryOutcome("job-r2", JobPhase.SUCCEEDED, "canary passed: 9 checks")
    plan = plan_rollout(
        "r2",
        previous,
        None,
        {"r1": observation("r1"), "r2": observation("r2", canary=passed)},
        True,
    )
    assert plan.revision == RevisionStatus(current="r2", candidate=None)
    assert plan.serve == "r2" and plan.keep == ("r2",)
    assert canary_of(plan).result is CanaryResult.PASSED
    assert [e.reason for e in plan.events] == ["CanaryPassed", "Promoted"]


def test_a_failed_canary_keeps_the_old_revision_serving_with_the_reason():
    previous = RevisionStatus(current="r1", candidate="r2")
    failed = CanaryOutcome("job-r2", JobPhase.FAILED, "FAIL status: over-limit prompt got 500")
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=failed)}
    plan = plan_rollout("r2", previous, None, observed, True)
    assert plan.serve == "r1"
    assert plan.revision == RevisionStatus(current="r1", candidate="r2")
    assert plan.keep == ("r1", "r2")
    assert canary_of(plan).result is CanaryResult.FAILED
    assert "over-limit prompt got 500" in (canary_of(plan).message or "")
    assert [e.type for e in plan.events] == ["Warning"]
    # The next pass says nothing new: events are for decisions, not for every pass.
    repeat = plan_rollout("r2", plan.revision, plan.canary, observed, True)
    assert repeat.events == [] and repeat.serve == "r1"


def test_a_restarted_operator_resumes_from_status_alone():
    """Status says a canary is running for r2; a fresh operator must not start another."""
    status = RevisionStatus(current="r1", candidate="r2")
    canary = CanaryStatus(revision="r2", job="job-r2", result=CanaryResult.RUNNING)
    running = CanaryOutcome("job-r2", JobPhase.RUNNING)
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=running)}
    plan = plan_rollout("r2", status, canary, observed, True)
    assert plan.start_canary is None and plan.serve == "r1"


def test_reverting_the_spec_drops_the_candidate():
    plan = plan_rollout(
        "r1", RevisionStatus(current="r1", candidate="r2"), None, {"r1": observation("r1")}, True
    )
    assert plan.revision == RevisionStatus(current="r1", candidate=None)
    assert plan.keep == ("r1",)


def test_canary_disabled_promotes_on_readiness():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1")}, canary_enabled=False)
    assert plan.serve == "r1" and canary_of(plan).result is CanaryResult.NOT_RUN
    assert canary_of(plan).message == "canary disabled in spec"


def test_a_disabled_canary_is_not_run_even_while_pods_start():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1", ready=0)}, False)
    assert plan.serve is None
    assert canary_of(plan).result is CanaryResult.NOT_RUN
    assert canary_of(plan).message == "canary disabled in spec"


def test_a_canary_whose_pools_were_refused_will_not_run():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1", pool_tokens=256)}, True)
    assert plan.start_canary is None and plan.serve is None
    assert canary_of(plan).result is CanaryResult.NOT_RUN
    assert canary_of(plan).message == "not run: the pool check refused this revision"


def test_a_status_written_with_the_old_skipped_result_still_reads():
    assert CanaryStatus.model_validate({"result": "Skipped"}).result is CanaryResult.NOT_RUN


# ---- retirement after a drain -------------------------------------------------------------

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
PASSED_R2 = CanaryOutcome("job-r2", JobPhase.SUCCEEDED, "canary passed")


def promoted_with_a_drain(now: datetime = T0) -> RolloutPlan:
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=PASSED_R2)}
    previous = RevisionStatus(current="r1", candidate="r2")
    return plan_rollout("r2", previous, None, observed, True, now=now, retire_after_seconds=30)


def test_promotion_switches_the_service_but_keeps_the_old_revision_until_the_delay():
    plan = promoted_with_a_drain()
    assert plan.serve == "r2"
    assert plan.keep == ("r2", "r1")
    assert plan.revision.current == "r2" and plan.revision.candidate is None
    assert plan.revision.retiring == [RetiringRevision(revision="r1", since=T0)]
    (promoted,) = [e for e in plan.events if e.reason == "Promoted"]
    assert "revision r1 drains for 30 s, then is removed" in promoted.message


def test_the_old_revision_is_retired_once_the_delay_has_passed_and_not_before():
    drained = promoted_with_a_drain().revision
    observed = {"r2": observation("r2", canary=PASSED_R2), "r1": observation("r1")}

    def at(seconds: float) -> RolloutPlan:
        now = T0 + timedelta(seconds=seconds)
        return plan_rollout("r2", drained, None, observed, True, now=now, retire_after_seconds=30)

    early = at(29.9)
    assert early.keep == ("r2", "r1") and early.serve == "r2"
    assert early.revision.retiring == drained.retiring
    assert early.events == []
    late = at(30)
    assert late.keep == ("r2",) and late.serve == "r2"
    assert late.revision.retiring is None
    assert [e.reason for e in late.events] == ["Retired"]
    assert "r1" in late.events[0].message
    # a restarted operator reads the same status and decides the same
    assert at(29.9) == early


def test_without_a_delay_the_old_revision_goes_at_promotion():
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=PASSED_R2)}
    previous = RevisionStatus(current="r1", candidate="r2")
    plan = plan_rollout("r2", previous, None, observed, True, now=T0, retire_after_seconds=0)
    assert plan.keep == ("r2",) and plan.revision.retiring is None


def test_a_new_rollout_during_the_drain_keeps_draining_the_old_revision():
    draining = promoted_with_a_drain().revision
    observed = {"r2": observation("r2"), "r3": observation("r3", ready=0)}
    now = T0 + timedelta(seconds=10)
    plan = plan_rollout("r3", draining, None, observed, True, now=now, retire_after_seconds=30)
    assert plan.serve == "r2"
    assert plan.keep == ("r2", "r3", "r1")
    assert [r.revision for r in plan.revision.retiring or []] == ["r1"]


def test_a_spec_reverted_to_the_draining_revision_makes_it_a_candidate_again_not_retired():
    draining = promoted_with_a_drain().revision
    observed = {"r2": observation("r2"), "r1": observation("r1")}
    now = T0 + timedelta(seconds=40)  # past the delay: it would be retired if still retiring
    plan = plan_rollout("r1", draining, None, observed, True, now=now, retire_after_seconds=30)
    assert plan.serve == "r2"  # the Service is never switched back without a canary
    assert plan.revision == RevisionStatus(current="r2", candidate="r1")
    assert "r1" in plan.keep
    assert [e.reason for e in plan.events] == ["RolloutStarted", "CanaryStarted"]


def test_a_crash_between_the_switch_and_the_status_write_still_drains_the_old_revision():
    """Status still says r1 serves; the crashed pass had switched the Service (and its seal) to
    r2. Status is the record, so the pass starts from r1, and r2 is promoted again from its
    own passed canary: r1 drains from this pass on."""
    stale = RevisionStatus(current="r1", candidate="r2")
    start = serving_revision(stale, "r2")
    assert start == stale
    observed = {"r2": observation("r2", canary=PASSED_R2), "r1": observation("r1")}
    plan = plan_rollout("r2", start, None, observed, True, now=T0, retire_after_seconds=30)
    assert plan.keep == ("r2", "r1") and plan.serve == "r2"
    assert plan.revision.retiring == [RetiringRevision(revision="r1", since=T0)]


def test_a_lost_status_forgets_the_drain_and_the_old_revision_is_retired_at_once():
    start = serving_revision(None, "r2")  # recovered from the operator's seal
    observed = {"r2": observation("r2", canary=PASSED_R2)}
    plan = plan_rollout("r2", start, None, observed, True, now=T0, retire_after_seconds=30)
    assert plan.keep == ("r2",)
