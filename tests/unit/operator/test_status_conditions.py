"""The status an InferenceDeployment shows for a rollout plan: conditions a user and a GitOps
tool act on."""

from datetime import UTC, datetime

from helpers.rollout import decode_pools, observation
from kvfence_operator.crd.types import (
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    RevisionStatus,
)
from kvfence_operator.decisions.canary import CanaryOutcome, JobPhase
from kvfence_operator.decisions.rollout import plan_rollout
from kvfence_operator.decisions.status import compute_status

SPEC = InferenceDeploymentSpec.model_validate(
    {"model": {"source": "builtin:tiny-random"}, "contextLength": 512,
     "router": {"apiKeysSecret": "k"}}
)  # fmt: skip
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def conditions(status: InferenceDeploymentStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (str(c.status), c.reason) for c in status.conditions}


def status_for(plan, observed, previous=None):
    return compute_status(
        SPEC, 3, previous or InferenceDeploymentStatus(), plan, observed, [],
        "http://tiny.default.svc:8000", now=NOW,
    )  # fmt: skip


def test_a_failed_canary_is_degraded_and_stalled_while_the_old_revision_serves():
    failed = CanaryOutcome("job-r2", JobPhase.FAILED, "kvfence canary FAIL: status_codes: 500")
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=failed)}
    plan = plan_rollout("r2", RevisionStatus(current="r1", candidate="r2"), None, observed, True)
    status = status_for(plan, observed)
    c = conditions(status)
    assert c["Ready"] == ("True", "Serving")  # r1 serves: a Deployment's Available
    ready = next(cond for cond in status.conditions if cond.type == "Ready")
    assert ready.message == (
        "revision r1 serves at http://tiny.default.svc:8000; revision r2 failed its canary"
    )
    assert c["CanaryPassed"] == ("False", "CanaryFailed")
    assert c["Degraded"] == c["Stalled"] == ("True", "CanaryFailed")
    assert c["Progressing"] == c["Reconciling"] == ("False", "CanaryFailed")
    assert status.endpoint == "http://tiny.default.svc:8000"  # r1 still serves
    assert all(cond.observed_generation == 3 for cond in status.conditions)


def test_a_refused_pool_says_why_once_with_the_remedy_and_its_canary_is_not_run():
    observed = {"r1": observation("r1", pool_tokens=256)}
    plan = plan_rollout("r1", None, None, observed, True)
    status = compute_status(
        SPEC, 3, InferenceDeploymentStatus(), plan, observed, decode_pools("r1", 256), None, NOW
    )
    c = conditions(status)
    assert c["Ready"] == ("False", "PoolInsufficient")
    assert c["CanaryPassed"] == ("Unknown", "CanaryNotRun")
    assert status.canary is not None and status.canary.result == "NotRun"
    ready = next(cond for cond in status.conditions if cond.type == "Ready")
    assert ready.message == (
        "pod r1-d (decode) has a KV pool of 256 tokens, smaller than contextLength 512; "
        "raise kvCacheMemory by 100% or lower contextLength to 256"
    )
    canary = next(cond for cond in status.conditions if cond.type == "CanaryPassed")
    assert canary.message == "revision r1: not run: the pool check refused this revision"


def test_a_rollout_in_progress_is_reconciling_and_not_ready():
    observed = {"r1": observation("r1", ready=0)}
    plan = plan_rollout("r1", None, None, observed, True)
    c = conditions(status_for(plan, observed))
    assert c["Progressing"] == c["Reconciling"] == ("True", "RolloutInProgress")
    assert c["Ready"] == ("False", "RolloutInProgress")
    assert c["Stalled"][0] == "False"


def test_transition_time_moves_only_when_a_condition_flips():
    observed = {"r1": observation("r1")}
    served = plan_rollout("r1", RevisionStatus(current="r1"), None, observed, True)
    first = status_for(served, observed)
    later = compute_status(
        SPEC, 4, first, served, observed, [], "http://x", now=NOW.replace(hour=13)
    )
    ready = {c.type: c for c in later.conditions}["Ready"]
    assert ready.status == "True" and ready.last_transition_time == NOW
    assert ready.observed_generation == 4
