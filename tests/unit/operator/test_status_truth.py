"""The status says true things (issue 14, item 5): each case as compute_status computes it, and
the reconcile pass against an in-memory API server for the errors it meets."""

import copy
import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from helpers.memory_kube import MemoryKube
from helpers.reconciling import body
from helpers.rollout import decode_pools, observation
from kvfence_operator.cluster.kube import KubeError
from kvfence_operator.crd.schema import printer_columns
from kvfence_operator.crd.types import (
    CanaryResult,
    CanaryStatus,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    RevisionStatus,
    RoleReplicas,
)
from kvfence_operator.decisions.findings import InvalidSpec
from kvfence_operator.decisions.pods import may_serve
from kvfence_operator.decisions.rollout import (
    CanaryOutcome,
    JobPhase,
    RevisionObservation,
    plan_rollout,
)
from kvfence_operator.decisions.status import compute_status
from kvfence_operator.reconcile.reconciler import Reconciler

BASE = {"model": {"source": "builtin:tiny-random"}, "contextLength": 512,
        "router": {"apiKeysSecret": "k"}}  # fmt: skip
SPEC = InferenceDeploymentSpec.model_validate(BASE)
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
ENDPOINT = "http://tiny.default.svc:8000"


def spec(**fields: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({**BASE, **fields})


def conditions(status: InferenceDeploymentStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (str(c.status), c.reason) for c in status.conditions}


def status_for(plan, observed, previous=None, spec_=SPEC, now=NOW, problems=()):
    return compute_status(
        spec_, 3, previous or InferenceDeploymentStatus(), plan, observed, [], ENDPOINT, now=now,
        problems=problems,
    )  # fmt: skip


# ---- 1. reverting after a failed canary ---------------------------------------------------


def failed_then_reverted(r1_canary: CanaryOutcome | None, enabled: bool = True):
    failed = CanaryOutcome("job-r2", JobPhase.FAILED, "kvfence canary FAIL: status_codes: 500")
    observed = {"r1": observation("r1", canary=r1_canary), "r2": observation("r2", canary=failed)}
    rolling = plan_rollout("r2", RevisionStatus(current="r1", candidate="r2"), None, observed, True)
    during = status_for(rolling, observed)
    assert conditions(during)["CanaryPassed"] == ("False", "CanaryFailed")
    # the spec is reverted: r1 is desired again, and nothing rolls
    back = {"r1": observed["r1"]}
    reverted = plan_rollout("r1", during.revision, during.canary, back, enabled)
    spec_ = SPEC if enabled else spec(canary={"enabled": False})
    return status_for(reverted, back, previous=during, spec_=spec_)


def test_reverting_after_a_failed_canary_describes_the_serving_revisions_passed_canary():
    passed = CanaryOutcome("job-r1", JobPhase.SUCCEEDED, "kvfence canary PASS: 6 checks")
    status = failed_then_reverted(passed)
    c = conditions(status)
    assert c["CanaryPassed"] == ("True", "CanaryPassed")
    assert status.canary == CanaryStatus(
        revision="r1", job="job-r1", result=CanaryResult.PASSED, message=passed.message
    )
    assert c["Ready"] == ("True", "Serving")
    assert c["Degraded"] == ("False", "AsExpected") and c["Stalled"][0] == "False"
    # the next pass keeps it: the serving revision's canary is carried
    again = plan_rollout("r1", status.revision, status.canary, {}, True)
    assert again.canary == status.canary


def test_reverting_with_canaries_disabled_or_the_job_gone_still_says_it_serves_rightly():
    disabled = failed_then_reverted(None, enabled=False)
    assert conditions(disabled)["CanaryPassed"] == ("True", "CanaryDisabled")
    gone = failed_then_reverted(None)
    assert conditions(gone)["CanaryPassed"] == ("True", "CanaryPassed")
    assert gone.canary is not None and gone.canary.revision == "r1"


# ---- 2. evicted pods --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "engine"),
    [
        ({"phase": "Running", "podIP": "10.0.0.2"}, True),
        ({"phase": "Pending"}, True),
        ({}, True),
        ({"phase": "Failed", "reason": "Evicted"}, False),
        ({"phase": "Succeeded"}, False),
    ],
)
def test_only_pods_that_can_still_run_are_engines(status, engine):
    pod = {"metadata": {"name": "p"}, "status": status}
    assert may_serve(pod) is engine
    deleting = {"metadata": {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert not may_serve({**deleting, "status": status})


# ---- 3. replicas: 0 ---------------------------------------------------------------------


def zero_decode(revision: str) -> RevisionObservation:
    seen = observation(revision)
    replicas = {**seen.replicas, "decode": RoleReplicas(ready=0, desired=0)}
    return RevisionObservation(revision, replicas, seen.pools, seen.canary)


def test_replicas_zero_is_scaled_to_zero_as_asked_not_degraded():
    observed = {"r1": zero_decode("r1")}
    plan = plan_rollout("r1", RevisionStatus(current="r1"), None, observed, True)
    status = status_for(plan, observed, spec_=spec(decode={"replicas": 0}))
    c = conditions(status)
    assert c["Ready"] == ("False", "ScaledToZero")
    assert c["Degraded"] == ("False", "ScaledToZero")
    assert c["Stalled"][0] == c["Progressing"][0] == c["Reconciling"][0] == "False"
    ready = next(cond for cond in status.conditions if cond.type == "Ready")
    assert ready.message == "spec.decode.replicas is 0: scaled to zero; nothing serves"


# ---- 4. Stalled only when progress stopped -----------------------------------------------


def restarting(ready: int = 0, desired: int = 1) -> dict[str, RevisionObservation]:
    seen = observation("r1")
    replicas = {**seen.replicas, "decode": RoleReplicas(ready=ready, desired=desired)}
    return {"r1": RevisionObservation("r1", replicas, seen.pools, seen.canary)}


def test_a_serving_pod_restarting_is_progressing_not_stalled_until_the_deadline():
    observed = restarting()
    plan = plan_rollout("r1", RevisionStatus(current="r1"), None, observed, True)
    first = status_for(plan, observed)
    c = conditions(first)
    assert c["Progressing"] == c["Reconciling"] == ("True", "ServingRevisionUnready")
    assert c["Degraded"] == ("True", "ServingRevisionUnready")
    assert c["Stalled"][0] == "False"
    assert first.progress is not None and first.progress.last_progress_time == NOW

    within = status_for(plan, observed, previous=first, now=NOW + timedelta(seconds=600))
    assert conditions(within)["Stalled"][0] == "False"
    late = status_for(plan, observed, previous=within, now=NOW + timedelta(seconds=601))
    assert conditions(late)["Stalled"] == ("True", "ProgressDeadlineExceeded")
    stalled = next(cond for cond in late.conditions if cond.type == "Stalled")
    assert "no progress for 600s (spec.rollout.progressDeadlineSeconds)" in stalled.message

    # the pod comes back: ready again, nothing stalled
    back = {"r1": observation("r1")}
    healed = status_for(plan, back, previous=late, now=NOW + timedelta(seconds=700))
    c = conditions(healed)
    assert c["Ready"] == ("True", "Serving") and c["Stalled"][0] == "False"
    assert healed.progress is None


def test_progress_resets_the_deadline_and_the_deadline_comes_from_the_spec():
    short = spec(rollout={"progressDeadlineSeconds": 30}, decode={"replicas": 2})
    plan = plan_rollout("r1", RevisionStatus(current="r1"), None, restarting(desired=2), True)
    first = status_for(plan, restarting(desired=2), spec_=short)
    later = NOW + timedelta(seconds=25)
    one_up = restarting(ready=1, desired=2)
    moved = status_for(plan, one_up, previous=first, spec_=short, now=later)
    # a pod became ready: progress (the other one is still awaited)
    assert moved.progress is not None and moved.progress.last_progress_time == later
    still = status_for(plan, one_up, previous=moved, spec_=short, now=later + timedelta(seconds=29))
    assert conditions(still)["Stalled"][0] == "False"
    stuck = status_for(plan, one_up, previous=still, spec_=short, now=later + timedelta(seconds=31))
    assert conditions(stuck)["Stalled"] == ("True", "ProgressDeadlineExceeded")
    assert "progressDeadlineSeconds" not in json.dumps(plan.revision.model_dump())


def test_a_running_canary_is_not_a_stall_and_a_terminal_verdict_is_one_at_once():
    running = CanaryOutcome("job-r2", JobPhase.RUNNING)
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=running)}
    previous = RevisionStatus(current="r1", candidate="r2")
    plan = plan_rollout("r2", previous, None, observed, True)
    first = status_for(plan, observed)
    late = status_for(plan, observed, previous=first, now=NOW + timedelta(hours=2))
    assert conditions(late)["Stalled"][0] == "False"
    assert conditions(late)["Progressing"] == ("True", "RolloutInProgress")

    failed = CanaryOutcome("job-r2", JobPhase.FAILED, "kvfence canary FAIL")
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=failed)}
    plan = plan_rollout("r2", previous, None, observed, True)
    assert conditions(status_for(plan, observed))["Stalled"] == ("True", "CanaryFailed")


# ---- 7. printer columns: the serving revision's, the candidate's in -o wide ---------------


def test_the_status_numbers_are_the_serving_revisions_and_the_candidates_are_apart():
    r1 = observation("r1")
    seen = observation("r2", ready=0, pool_tokens=2048)
    observed = {"r1": r1, "r2": seen}
    plan = plan_rollout("r2", RevisionStatus(current="r1", candidate="r2"), None, observed, True)
    status = compute_status(
        SPEC, 3, InferenceDeploymentStatus(), plan, observed, decode_pools("r2", 2048),
        ENDPOINT, now=NOW,
    )  # fmt: skip
    assert status.decode == RoleReplicas(ready=1, desired=1)
    assert status.min_pool_tokens == 1024
    assert status.context_length is not None and status.context_length.effective == 512
    assert status.candidate is not None and status.candidate.revision == "r2"
    assert status.candidate.decode == RoleReplicas(ready=0, desired=1)
    assert status.candidate.min_pool_tokens == 2048

    default = [c["name"] for c in printer_columns() if not c.get("priority")]
    wide = [c["name"] for c in printer_columns() if c.get("priority") == 1]
    assert default == ["Ready", "Context", "Pool", "Prefill", "Decode", "Revision", "Age"]
    assert wide == [
        "Canary", "Isolation", "Candidate", "C-Pool", "C-Prefill", "C-Decode", "P-Scale", "D-Scale"
    ]  # fmt: skip
    paths = {c["name"]: c["jsonPath"] for c in printer_columns()}
    assert all(paths[n].startswith(".status.candidate.") for n in wide[3:6])
    assert all(paths[n].startswith(".status.autoscaling.") for n in wide[6:])


# ---- 5. errors the operator meets; 6. a status that does not parse -----------------------


class RefusingKube(MemoryKube):
    """The in-memory API server, answering `status` to creating any object of `kind`."""

    def __init__(self, kind: str, status: int, message: str, *objects: dict[str, Any]) -> None:
        super().__init__(*objects)
        self.refused, self.status, self.message = kind, status, message

    def create(self, obj: Mapping[str, Any], dry_run: bool = False) -> bool:
        if obj["kind"] == self.refused:
            answer = {"kind": "Status", "status": "Failure", "message": self.message}
            raise KubeError(self.status, "POST", "/apis/apps/v1/...", json.dumps(answer))
        return super().create(obj, dry_run)


KEYS = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys"}, "data": {}}
QUOTA = ('deployments.apps "tiny-x-decode" is forbidden: exceeded quota: compute, '
         "requested: requests.cpu=1, used: requests.cpu=4, limited: requests.cpu=4")  # fmt: skip


def no_pods(pod: str, *_: Any) -> Any:
    raise AssertionError(f"{pod} was probed")


def test_a_refused_create_is_degraded_with_the_apis_message_and_one_event():
    kube = RefusingKube("Deployment", 403, QUOTA, KEYS)
    reconciler = Reconciler(kube, "kvfence-system", read_pool=no_pods)
    outcome = reconciler.reconcile(body())
    degraded = next(c for c in outcome.status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "CreateFailed")
    assert "(403): " + QUOTA in degraded.message
    assert [e.reason for e in outcome.events if e.type == "Warning"] == ["CreateFailed"] * 3
    # the pass went on with what it could
    assert {k for k, _ in kube.objects} >= {"Service", "ConfigMap", "NetworkPolicy", "Secret"}
    stalled = next(c for c in outcome.status.conditions if c.type == "Stalled")
    assert stalled.status == "False"  # a quota can be raised: not terminal

    again = reconciler.reconcile(
        {**body(), "status": outcome.status.model_dump(mode="json", by_alias=True)}
    )
    assert not [e for e in again.events if e.reason == "CreateFailed"]  # not every pass


def test_a_create_the_api_rejects_as_invalid_is_a_terminal_stall():
    message = 'Deployment.apps "x" is invalid: spec.template.spec.tolerations[0].operator'
    kube = RefusingKube("Deployment", 422, message, KEYS)
    outcome = Reconciler(kube, "kvfence-system", read_pool=no_pods).reconcile(body())
    c = conditions(outcome.status)
    assert c["Degraded"] == ("True", "CreateRejected") == c["Stalled"]


def test_a_missing_api_keys_secret_is_degraded_naming_it_and_the_pass_goes_on():
    kube = MemoryKube()
    outcome = Reconciler(kube, "kvfence-system", read_pool=no_pods).reconcile(body())
    degraded = next(c for c in outcome.status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ApiKeysSecretMissing")
    assert degraded.message.startswith("Secret keys (spec.router.apiKeysSecret) does not exist")
    assert [e.reason for e in outcome.events].count("ApiKeysSecretMissing") == 1
    assert [k for k, _ in kube.objects].count("Deployment") == 3


def test_a_status_that_does_not_parse_is_dropped_with_a_log_line_not_invalid_spec(caplog):
    kube = MemoryKube(KEYS)
    garbage = {"conditions": [{"type": "Ready", "status": "Maybe"}], "revision": "r1"}
    with caplog.at_level(logging.WARNING):
        outcome = Reconciler(kube, "kvfence-system", read_pool=no_pods).reconcile(
            {**body(), "status": garbage}
        )
    assert "the stored status does not parse" in caplog.text
    assert "starting from an empty status" in caplog.text
    assert all(c.reason != "InvalidSpec" for c in outcome.status.conditions)

    broken = copy.deepcopy(body())
    broken["spec"]["contextLength"] = 0
    with pytest.raises(InvalidSpec, match="contextLength"):
        Reconciler(kube, "kvfence-system", read_pool=no_pods).reconcile(broken)
