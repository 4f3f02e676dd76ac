"""Status truth at a rollout and a scale-up (issue 34 items 3, 4, 7; issue 26 item 11): Ready is a
Deployment's "Available" (the serving revision serves with at least its minimum available),
Progressing says a rollout or pods starting; a crash-looping engine is Degraded in its own
words; a refused pool and a crash loop are one Event each; a starting pod is no Warning. Each
case as the pure decisions compute it."""

from datetime import UTC, datetime, timedelta
from typing import Any

from helpers.rollout import decode_pools, observation
from kvfence_operator.crd.types import (
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    RevisionStatus,
    RoleReplicas,
)
from kvfence_operator.decisions.findings import Findings, engine_crash_loop
from kvfence_operator.decisions.pods import engine_failure, gate_event_due
from kvfence_operator.decisions.pool_gate import PodGate
from kvfence_operator.decisions.rollout import RevisionObservation, plan_rollout
from kvfence_operator.decisions.status import compute_status, pool_events, problem_events

SPEC = InferenceDeploymentSpec.model_validate(
    {"model": {"source": "builtin:tiny-random"}, "contextLength": 512,
     "router": {"apiKeysSecret": "k"}}
)  # fmt: skip
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
ENDPOINT = "http://tiny.default.svc:8000"


def conditions(status: InferenceDeploymentStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (str(c.status), c.reason) for c in status.conditions}


def message(status: InferenceDeploymentStatus, kind: str) -> str:
    return next(c.message for c in status.conditions if c.type == kind)


def with_decode(revision: str, ready: int, desired: int) -> RevisionObservation:
    seen = observation(revision)
    replicas = {**seen.replicas, "decode": RoleReplicas(ready=ready, desired=desired)}
    return RevisionObservation(revision, replicas, seen.pools, seen.canary)


def status_for(plan, observed, previous=None, pools=(), problems=(), now=NOW):
    return compute_status(
        SPEC, 3, previous or InferenceDeploymentStatus(), plan, observed, list(pools), ENDPOINT,
        now=now, problems=problems,
    )  # fmt: skip


# ---- Ready: the serving revision serves -------------------------------------------------


def test_ready_stays_true_while_a_rollout_runs_and_the_old_revision_serves():
    observed = {"r1": observation("r1"), "r2": observation("r2", ready=0)}
    plan = plan_rollout("r2", RevisionStatus(current="r1", candidate="r2"), None, observed, True)
    status = status_for(plan, observed)
    c = conditions(status)
    assert c["Ready"] == ("True", "Serving")
    assert (
        message(status, "Ready") == f"revision r1 serves at {ENDPOINT}; revision r2 is rolling out"
    )
    assert c["Progressing"] == c["Reconciling"] == ("True", "RolloutInProgress")
    assert c["Degraded"] == ("False", "AsExpected") and c["Stalled"][0] == "False"


def test_a_scale_up_is_ready_and_progressing_not_degraded_until_the_new_pod_serves():
    starting = {"r1": with_decode("r1", ready=2, desired=3)}
    plan = plan_rollout("r1", RevisionStatus(current="r1"), None, starting, True)
    status = status_for(plan, starting)
    c = conditions(status)
    assert c["Ready"] == ("True", "Serving")
    assert c["Progressing"] == c["Reconciling"] == ("True", "ReplicasStarting")
    assert "decode 2/3" in message(status, "Progressing")
    assert c["Degraded"] == ("False", "AsExpected") and c["Stalled"][0] == "False"
    assert status.progress is not None  # a scale-up that never ends stalls at the deadline

    done = {"r1": with_decode("r1", ready=3, desired=3)}
    c = conditions(status_for(plan, done, previous=status, now=NOW + timedelta(seconds=30)))
    assert c["Ready"] == ("True", "Serving") and c["Progressing"] == ("False", "RolloutComplete")


def test_below_its_minimum_available_the_serving_revision_is_not_ready_and_degraded():
    # 3 decode replicas, 1 ready: more than the one pod the PodDisruptionBudgets allow is down
    for seen in (with_decode("r1", ready=1, desired=3), with_decode("r1", ready=0, desired=1)):
        observed = {"r1": seen}
        plan = plan_rollout("r1", RevisionStatus(current="r1"), None, observed, True)
        c = conditions(status_for(plan, observed))
        assert c["Ready"] == ("False", "ServingRevisionUnready"), seen
        assert c["Degraded"] == ("True", "ServingRevisionUnready")
        assert c["Progressing"] == ("True", "ServingRevisionUnready")


def test_the_serving_revision_down_during_a_rollout_is_said_not_hidden_by_the_rollout():
    observed = {"r1": with_decode("r1", ready=0, desired=1), "r2": observation("r2", ready=0)}
    plan = plan_rollout("r2", RevisionStatus(current="r1", candidate="r2"), None, observed, True)
    c = conditions(status_for(plan, observed))
    assert c["Ready"] == ("False", "ServingRevisionUnready")
    assert c["Degraded"] == ("True", "ServingRevisionUnready")
    assert c["Progressing"] == ("True", "RolloutInProgress")


def test_a_first_rollout_is_not_ready_until_promoted():
    observed = {"r1": observation("r1", ready=0)}
    plan = plan_rollout("r1", None, None, observed, True)
    status = status_for(plan, observed)
    assert conditions(status)["Ready"] == ("False", "RolloutInProgress")
    assert message(status, "Ready") == "revision r1 is not promoted yet; nothing serves"


# ---- one Event per pool decision, none for a pod starting --------------------------------


def test_a_refused_pool_is_one_warning_event_not_one_per_pass():
    observed = {"r1": observation("r1", pool_tokens=256)}
    plan = plan_rollout("r1", None, None, observed, True)
    pools = decode_pools("r1", 256)
    first = status_for(plan, observed, pools=pools)
    assert conditions(first)["Stalled"] == ("True", "PoolInsufficient")
    (event,) = pool_events(InferenceDeploymentStatus(), first)
    assert (event.type, event.reason) == ("Warning", "PoolInsufficient")
    assert event.message == message(first, "Stalled")
    assert "raise kvCacheMemory by 100% or lower contextLength to 256" in event.message
    again = status_for(plan, observed, previous=first, pools=pools)
    assert pool_events(first, again) == []
    # a pool that holds the context says nothing here (its pods' gates do)
    fits = {"r1": observation("r1")}
    held = status_for(plan_rollout("r1", None, None, fits, True), fits, pools=decode_pools("r1"))
    assert pool_events(InferenceDeploymentStatus(), held) == []


def gate(sufficient: bool, reason: str = "PoolUnknown") -> PodGate:
    return PodGate("p", sufficient, reason, "pod p: no pod IP yet")  # type: ignore[arg-type]


def pod_with_gate(status: str | None) -> dict[str, Any]:
    conditions = [] if status is None else [{"type": "kvfence.dev/kv-pool", "status": status}]
    return {"metadata": {"name": "p"}, "status": {"conditions": conditions}}


def test_a_starting_pod_is_no_warning_a_pod_taking_or_leaving_traffic_is_an_event():
    assert not gate_event_due(pod_with_gate(None), gate(False))  # no IP yet: starting
    assert not gate_event_due(pod_with_gate("False"), gate(False, "PoolTooSmall"))  # the revision's
    assert gate_event_due(pod_with_gate(None), gate(True, "PoolHoldsContext"))
    assert gate_event_due(pod_with_gate("False"), gate(True, "PoolHoldsContext"))
    assert not gate_event_due(pod_with_gate("True"), gate(True, "PoolHoldsContext"))
    assert gate_event_due(pod_with_gate("True"), gate(False))  # a serving pod stops serving


# ---- a crash-looping engine, in its own words ---------------------------------------------

GONE = (
    "engine failed to start: ValueError: cannot load model '/models/tiny.gguf': no such file "
    "(on a cluster the path is inside the engine container: put the model there with "
    "spec.model.volume)"
)


def engine_pod(name: str, role: str, state: dict[str, Any], last: dict[str, Any] | None = None,
               ready: bool = False) -> dict[str, Any]:  # fmt: skip
    return {
        "metadata": {"name": name, "labels": {"kvfence.dev/role": role}},
        "status": {
            "containerStatuses": [
                {"name": "engine", "ready": ready, "restartCount": 3, "state": state,
                 "lastState": last or {}}
            ]
        },
    }  # fmt: skip


def failed(message: str = GONE + "\n", code: int = 1) -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": "Error", "message": message}}


BACKOFF = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}}


def test_a_crash_looping_engine_is_one_problem_in_its_own_words_the_same_across_restarts():
    waiting = [
        engine_pod("tiny-r1-prefill-a", "prefill", BACKOFF, failed()),
        engine_pod("tiny-r1-decode-b", "decode", BACKOFF, failed()),
    ]
    problem = engine_crash_loop("r1", waiting)
    assert problem is not None and problem.reason == "EngineCrashLooping"
    assert problem.message == (
        "revision r1: its engine pods crash-loop (not ready since they failed; kubectl get pods "
        f"-l kvfence.dev/revision=r1): exited 1: {GONE}"
    )
    # the same words when only one of them failed yet: a second pod failing alike is no new Event
    assert engine_crash_loop("r1", waiting[:1]) == problem
    # restarted, loading again: the same failure, the same words (no flicker, no new Event)
    running = [engine_pod(p["metadata"]["name"], p["metadata"]["labels"]["kvfence.dev/role"],
                          {"running": {}}, failed()) for p in waiting]  # fmt: skip
    assert engine_crash_loop("r1", running) == problem
    # ready again: over
    recovered = [engine_pod("tiny-r1-decode-b", "decode", {"running": {}}, failed(), ready=True)]
    assert engine_crash_loop("r1", recovered) is None
    # never failed, or exited 0: nothing
    assert engine_crash_loop("r1", [engine_pod("x", "decode", {"running": {}})]) is None
    assert engine_failure(engine_pod("x", "decode", BACKOFF, failed("", 0))) is None


def test_a_termination_message_from_the_logs_gives_its_last_line_and_no_message_the_reason():
    logs = "INFO loading\nTraceback ...\nRuntimeError: CUDA out of memory\n\n"
    said = engine_failure(engine_pod("p", "decode", BACKOFF, failed(logs, 1)))
    assert said is not None and said.reason == "RuntimeError: CUDA out of memory"
    killed = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    said = engine_failure(engine_pod("p", "decode", BACKOFF, killed))
    assert said is not None and (said.exit_code, said.reason) == (137, "OOMKilled")


def test_a_crash_loop_is_degraded_with_its_reason_and_one_event():
    pods = [engine_pod("tiny-r1-decode-b", "decode", BACKOFF, failed())]
    problem = engine_crash_loop("r1", pods)
    assert problem is not None
    observed = {"r1": observation("r1", ready=0)}
    plan = plan_rollout("r1", None, None, observed, True)
    first = status_for(plan, observed, problems=[problem])
    c = conditions(first)
    assert c["Degraded"] == ("True", "EngineCrashLooping")
    assert GONE in message(first, "Degraded")
    assert c["Ready"] == ("False", "RolloutInProgress")
    found = Findings(problems=[problem])
    (event,) = problem_events(InferenceDeploymentStatus(), first, found)
    assert (event.type, event.reason, event.message) == ("Warning", "EngineCrashLooping",
                                                         problem.message)  # fmt: skip
    again = status_for(plan, observed, previous=first, problems=[problem])
    assert problem_events(first, again, found) == []
