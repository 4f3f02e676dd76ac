"""The canary Job: a finding (exit 1) fails it at once; a canary that could not run is retried,
then reported as CouldNotRun (no verdict, not promoted, not a finding); a new value of the
re-run annotation runs a candidate's canary again."""

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from helpers.builders import instance_for, sample_spec
from helpers.rollout import observation
from kvfence_engine.canary import EXIT_CANNOT_RUN, EXIT_FAIL
from kvfence_engine.contracts import IMPLICATED_BACKENDS
from kvfence_operator.builders.canary_job import build_canary_job
from kvfence_operator.crd.types import (
    CanaryResult,
    CanaryStatus,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    RevisionStatus,
)
from kvfence_operator.decisions.canary import (
    ANNOTATION_RERUN_CANARY,
    CanaryOutcome,
    JobPhase,
    canary_outcome,
    job_context_length,
    job_mismatch,
    rerun_requested,
    rerun_value,
)
from kvfence_operator.decisions.rollout import kept_verdict, plan_rollout
from kvfence_operator.decisions.status import compute_status
from kvfence_operator.reconcile.decide import _built_context, _ran_with

JOB = "tiny-r2-canary"
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SPEC = InferenceDeploymentSpec.model_validate(
    {"model": {"source": "builtin:tiny-random"}, "contextLength": 512,
     "router": {"apiKeysSecret": "k"}}
)  # fmt: skip


def job(reason: str | None = None, message: str = "") -> dict[str, Any]:
    conditions = []
    if reason is not None:
        kind = "Complete" if reason == "CompletionsReached" else "Failed"
        conditions = [{"type": kind, "status": "True", "reason": reason, "message": message}]
    return {"metadata": {"name": JOB}, "status": {"conditions": conditions}}


def pod(n: int, state: dict[str, Any], phase: str = "Failed") -> dict[str, Any]:
    return {
        "metadata": {"name": f"{JOB}-{n}", "creationTimestamp": f"2026-11-30T12:00:0{n}Z"},
        "status": {"phase": phase, "containerStatuses": [{"name": "canary", "state": state}]},
    }


def exited(n: int, code: int, message: str = "") -> dict[str, Any]:
    return pod(n, {"terminated": {"exitCode": code, "message": message}})


def test_the_job_fails_at_once_on_a_finding_and_retries_a_canary_that_could_not_run():
    spec = build_canary_job(sample_spec("minimal"), instance_for("minimal"), "r2")["spec"]
    assert spec["backoffLimit"] == 3
    assert spec["podFailurePolicy"]["rules"] == [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "canary", "operator": "In", "values": [EXIT_FAIL]},
        },
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
    assert spec["template"]["spec"]["containers"][0]["name"] == "canary"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    assert EXIT_FAIL == 1 and EXIT_CANNOT_RUN == 2  # what `kvfence canary` promises


def test_a_finding_is_a_failure_with_the_canarys_summary():
    found = canary_outcome(
        job("PodFailurePolicy", "Container canary for pod default/x failed with exit code 1"),
        [exited(1, 2, "kvfence canary ERROR: target unreachable"),
         exited(2, 1, "kvfence canary FAIL: marker: tenant B saw A's marker")],
    )  # fmt: skip
    assert found == CanaryOutcome(
        JOB, JobPhase.FAILED, "kvfence canary FAIL: marker: tenant B saw A's marker"
    )
    # a Job made before the podFailurePolicy (backoffLimit 0): exit 1 is still a finding
    legacy = canary_outcome(job("BackoffLimitExceeded"), [exited(1, 1, "kvfence canary FAIL")])
    assert legacy.phase is JobPhase.FAILED


def test_a_findings_implicated_backends_are_read_apart_from_its_summary():
    message = f"kvfence canary FAIL: engine_counters: ...\n{IMPLICATED_BACKENDS} http://a http://b"
    found = canary_outcome(job("PodFailurePolicy"), [exited(1, 1, message)])
    assert found.message == "kvfence canary FAIL: engine_counters: ..."
    assert found.implicated == ("http://a", "http://b")


def test_tries_that_all_could_not_run_are_no_verdict():
    tries = [exited(n, 2, f"kvfence canary ERROR: try {n}: connection refused") for n in range(4)]
    outcome = canary_outcome(
        job("BackoffLimitExceeded", "Job has reached the specified backoff limit"), tries
    )
    assert outcome.phase is JobPhase.COULD_NOT_RUN
    assert outcome.message == (
        "could not run (BackoffLimitExceeded): no verdict in 4 tries; "
        "last try: kvfence canary ERROR: try 3: connection refused"
    )
    # no termination message (argparse refused a flag): the exit code is said instead
    silent = canary_outcome(job("BackoffLimitExceeded"), [exited(1, 2)])
    assert silent.message.endswith("last try: exit code 2")


def test_an_image_that_never_pulls_runs_out_the_deadline_without_a_verdict():
    waiting = pod(
        1,
        {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x:1"'}},
        phase="Pending",
    )
    outcome = canary_outcome(
        job("DeadlineExceeded", "Job was active longer than specified deadline"), [waiting]
    )
    assert outcome.phase is JobPhase.COULD_NOT_RUN
    assert outcome.message.startswith("could not run (DeadlineExceeded): the Job ran past")
    assert outcome.message.endswith('last try: ImagePullBackOff: Back-off pulling image "x:1"')
    gone = canary_outcome(job("DeadlineExceeded"), [])  # the Job deleted its pods
    assert gone.phase is JobPhase.COULD_NOT_RUN and "activeDeadlineSeconds" in gone.message


def test_a_job_still_retrying_is_running_and_a_complete_one_passed():
    retrying = canary_outcome(job(), [exited(1, 2, "kvfence canary ERROR: x")])
    assert retrying.phase is JobPhase.RUNNING
    passed = canary_outcome(
        job("CompletionsReached"),
        [exited(1, 2, "ERROR"), exited(2, 0, "kvfence canary PASS: 6 checks")],
    )
    assert passed == CanaryOutcome(JOB, JobPhase.SUCCEEDED, "kvfence canary PASS: 6 checks")


def could_not_run_plan(previous_canary=None):
    outcome = CanaryOutcome(JOB, JobPhase.COULD_NOT_RUN, "could not run (DeadlineExceeded): x")
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=outcome)}
    previous = RevisionStatus(current="r1", candidate="r2")
    return plan_rollout("r2", previous, previous_canary, observed, True), observed


def test_a_canary_that_could_not_run_keeps_the_old_revision_serving_and_says_so_once():
    plan, _ = could_not_run_plan()
    assert plan.serve == "r1" and plan.keep == ("r1", "r2") and plan.start_canary is None
    assert plan.revision == RevisionStatus(current="r1", candidate="r2")
    assert plan.canary.result is CanaryResult.COULD_NOT_RUN
    assert plan.canary.message == "could not run (DeadlineExceeded): x"
    (event,) = plan.events
    assert (event.type, event.reason) == ("Warning", "CanaryCouldNotRun")
    assert event.message == (
        "revision r2 could not run its canary: could not run (DeadlineExceeded): x; "
        "revision r1 keeps serving"
    )
    again, _ = could_not_run_plan(plan.canary)
    assert again.events == []


def test_a_canary_that_could_not_run_is_degraded_but_not_a_failed_canary():
    plan, observed = could_not_run_plan()
    status = compute_status(
        SPEC, 3, InferenceDeploymentStatus(), plan, observed, [], "http://tiny:8000", NOW
    )
    c = {c.type: (str(c.status), c.reason, c.message) for c in status.conditions}
    assert c["Degraded"] == ("True", "CanaryCouldNotRun", "revision r2: could not run "
                             "(DeadlineExceeded): x")  # fmt: skip
    assert c["CanaryPassed"][:2] == ("Unknown", "CanaryCouldNotRun")
    # r1 serves: Ready (a Deployment's Available), Degraded says the candidate's verdict
    assert c["Ready"] == ("True", "Serving", "revision r1 serves at http://tiny:8000; "
                          "revision r2 could not run its canary")  # fmt: skip
    assert c["Progressing"][:2] == ("False", "CanaryCouldNotRun")
    assert status.canary is not None and status.canary.result == "CouldNotRun"


def test_the_job_records_the_rerun_value_it_ran_with():
    spec, instance = sample_spec("minimal"), instance_for("minimal")
    first = build_canary_job(spec, instance, "r2")
    assert rerun_value(first) == "" and "annotations" not in first["metadata"]
    assert not rerun_requested(first, "")
    assert rerun_requested(first, "2026-11-30")
    again = build_canary_job(spec, instance, "r2", rerun="2026-11-30")
    assert again["metadata"]["annotations"] == {ANNOTATION_RERUN_CANARY: "2026-11-30"}
    assert not rerun_requested(again, "2026-11-30")
    assert rerun_requested(again, "")  # the annotation removed: a new value too
    idf = {"metadata": {"annotations": {ANNOTATION_RERUN_CANARY: "2026-11-30"}}}
    assert rerun_value(idf) == "2026-11-30"


# ---- issue 26: only the Job the operator built has a verdict, and a verdict is kept ----------


def built(context: int | None = None, rerun: str = "") -> dict[str, Any]:
    return build_canary_job(SPEC, instance_for("minimal"), "r2", context, rerun)


def served_back(job_: dict[str, Any]) -> dict[str, Any]:
    """The Job as the API server returns it: its defaults filled in, its labels added to."""
    live = copy.deepcopy(job_)
    live["metadata"]["uid"] = "u-job"
    live["spec"].update(completions=1, parallelism=1, suspend=False, completionMode="NonIndexed")
    live["spec"]["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": "u-job"}}
    template = live["spec"]["template"]
    template["metadata"]["labels"]["batch.kubernetes.io/job-name"] = JOB
    pod_spec = template["spec"]
    pod_spec.update(dnsPolicy="ClusterFirst", schedulerName="default-scheduler")
    for c in pod_spec["containers"]:
        c.update(imagePullPolicy="IfNotPresent", terminationMessagePath="/dev/termination-log")
        for requests in c["resources"].values():
            requests["cpu"] = "0.1" if requests.get("cpu") == "100m" else requests.get("cpu")
    return live


def test_the_operators_job_as_the_server_returns_it_is_its_own():
    assert job_mismatch(served_back(built()), built()) is None
    assert job_mismatch(served_back(built(384, "x")), built(384, "x")) is None


def edited(change) -> dict[str, Any]:
    live = served_back(built())
    change(live["spec"]["template"]["spec"]["containers"][0], live)
    return live


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda c, _: c.update(image="busybox:1"), "image"),
        (lambda c, _: c.update(command=["true"]), "command"),
        (lambda c, _: c["args"].remove("--termination-log"), "args"),
        (lambda c, _: c["env"].append({"name": "X", "value": "1"}), "env"),
        (lambda c, _: c["env"][-1].update(value="my own key", valueFrom=None), "env"),
        (
            lambda _, j: j["spec"]["template"]["spec"].update(
                initContainers=[{"name": "x", "image": "busybox:1"}]
            ),
            "init containers",
        ),
        (lambda _, j: j["spec"].update(podFailurePolicy={"rules": []}), "spec"),
        (lambda _, j: j["spec"]["template"]["spec"]["volumes"].pop(), "spec"),
    ],
)
def test_a_job_with_the_canarys_name_but_not_its_spec_is_not_the_operators(change, why):
    reason = job_mismatch(edited(change), built())
    assert reason is not None and why in reason


def test_the_context_a_job_records_must_be_one_the_spec_allows():
    lowered = {**SPEC.model_dump(by_alias=True, exclude_none=True), "poolPolicy": "LowerContext",
               "minContextLength": 256}  # fmt: skip
    assert job_context_length(built(384)) == 384
    assert job_context_length({"spec": {}}) is None
    spec = InferenceDeploymentSpec.model_validate(lowered)
    assert _built_context(built(384), spec) == 384
    assert _built_context(built(128), spec) == 512  # below minContextLength: fails the compare
    assert _built_context(built(384), SPEC) == 512  # Refuse serves contextLength or nothing


FAILED_R2 = CanaryStatus(
    revision="r2", job=JOB, job_uid="u-1", rerun="", result=CanaryResult.FAILED, message="leak"
)


@pytest.mark.parametrize(
    ("outcome", "kept"),
    [
        (None, True),  # the Job is gone
        (CanaryOutcome(JOB, JobPhase.SUCCEEDED, uid="u-2"), True),  # another Job of the name
        (CanaryOutcome(JOB, JobPhase.FAILED, "leak", uid="u-1"), False),  # the same Job
    ],
)
def test_a_verdict_that_stopped_the_rollout_is_kept_when_its_job_goes_or_is_replaced(outcome, kept):
    assert kept_verdict(FAILED_R2, outcome) is kept
    observed = {"r1": observation("r1"), "r2": observation("r2", canary=outcome)}
    previous = RevisionStatus(current="r1", candidate="r2")
    plan = plan_rollout("r2", previous, FAILED_R2, observed, True)
    assert plan.serve == "r1" and plan.start_canary is None and plan.events == []
    assert plan.canary == FAILED_R2


def test_a_could_not_run_verdict_is_kept_too_and_a_running_one_is_not():
    could_not = FAILED_R2.model_copy(update={"result": CanaryResult.COULD_NOT_RUN})
    assert kept_verdict(could_not, None)
    running = FAILED_R2.model_copy(update={"result": CanaryResult.RUNNING})
    assert not kept_verdict(running, None)  # a Job gone before its verdict is started again
    observed = {"r1": observation("r1"), "r2": observation("r2")}
    previous = RevisionStatus(current="r1", candidate="r2")
    plan = plan_rollout("r2", previous, running, observed, True)
    assert plan.start_canary == "r2"
    # a status from before the uid was kept: the Job there is the one it came from
    older = FAILED_R2.model_copy(update={"job_uid": None})
    assert kept_verdict(older, None)
    assert not kept_verdict(older, CanaryOutcome(JOB, JobPhase.SUCCEEDED, uid="u-2"))


def test_the_rerun_value_a_canary_ran_with_is_its_verdicts_when_its_job_is_gone():
    annotated = build_canary_job(SPEC, instance_for("minimal"), "r2", rerun="b")
    assert _ran_with(FAILED_R2.model_copy(update={"rerun": "a"}), None) == "a"
    assert _ran_with(FAILED_R2.model_copy(update={"rerun": "a"}), annotated) == "a"
    assert _ran_with(FAILED_R2.model_copy(update={"rerun": None}), annotated) == "b"
    assert _ran_with(FAILED_R2.model_copy(update={"rerun": None}), None) is None
    assert _ran_with(None, annotated) == "b"
    assert _ran_with(None, None) is None
