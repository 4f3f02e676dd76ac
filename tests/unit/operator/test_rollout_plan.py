"""The rollout state machine: promotion only after pods, pools and the canary; state in status."""

from helpers.rollout import observation
from kvfence_operator.crd.types import (
    CanaryResult,
    CanaryStatus,
    RevisionStatus,
)
from kvfence_operator.rollout import CanaryOutcome, JobPhase, plan_rollout


def test_first_revision_waits_for_pods_before_any_canary():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1", ready=0)}, canary_enabled=True)
    assert plan.revision == RevisionStatus(current=None, candidate="r1")
    assert plan.start_canary is None and plan.serve is None
    assert plan.keep == ("r1",)
    assert plan.canary.result is CanaryResult.PENDING


def test_a_ready_candidate_with_enough_pool_starts_its_canary_once():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1")}, canary_enabled=True)
    assert plan.start_canary == "r1"
    assert plan.canary.result is CanaryResult.RUNNING
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
    assert plan.canary.result is CanaryResult.PASSED
    assert [e.reason for e in plan.events] == ["CanaryPassed", "Promoted"]


def test_a_failed_canary_keeps_the_old_revision_serving_with_the_reason():
    previous = RevisionStatus(current="r1", candidate="r2")
    failed = CanaryOutcome("job-r2", JobPhase.FAILED, "FAIL status: over-limit prompt got 500")
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=failed)}
    plan = plan_rollout("r2", previous, None, observed, True)
    assert plan.serve == "r1"
    assert plan.revision == RevisionStatus(current="r1", candidate="r2")
    assert plan.keep == ("r1", "r2")
    assert plan.canary.result is CanaryResult.FAILED
    assert "over-limit prompt got 500" in plan.canary.message
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
    assert plan.serve == "r1" and plan.canary.result is CanaryResult.NOT_RUN
    assert plan.canary.message == "canary disabled in spec"


def test_a_disabled_canary_is_not_run_even_while_pods_start():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1", ready=0)}, False)
    assert plan.serve is None
    assert plan.canary.result is CanaryResult.NOT_RUN
    assert plan.canary.message == "canary disabled in spec"


def test_a_canary_whose_pools_were_refused_will_not_run():
    plan = plan_rollout("r1", None, None, {"r1": observation("r1", pool_tokens=256)}, True)
    assert plan.start_canary is None and plan.serve is None
    assert plan.canary.result is CanaryResult.NOT_RUN
    assert plan.canary.message == "not run: the pool check refused this revision"


def test_a_status_written_with_the_old_skipped_result_still_reads():
    assert CanaryStatus.model_validate({"result": "Skipped"}).result is CanaryResult.NOT_RUN
