"""Conditions behave like metav1.Condition: the transition time moves only when status flips."""

from datetime import UTC, datetime, timedelta, timezone

import pytest

from helpers.crd_admission import crd_admission
from kvfence_operator.crd.types import (
    ConditionStatus,
    ConditionType,
    InferenceDeploymentStatus,
    RoleReplicas,
)
from kvfence_operator.decisions.status import find_condition, set_condition

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)
TRUE, FALSE = ConditionStatus.TRUE, ConditionStatus.FALSE


def test_a_new_condition_starts_its_transition_clock_now():
    (ready,) = set_condition([], ConditionType.READY, FALSE, "PodsStarting", "0/2 ready", 1, T0)
    assert ready.type == "Ready"
    assert ready.status is FALSE
    assert ready.last_transition_time == T0
    assert ready.observed_generation == 1


def test_same_status_with_a_new_reason_keeps_the_transition_time():
    conditions = set_condition([], ConditionType.READY, FALSE, "PodsStarting", "0/2", 1, T0)
    (ready,) = set_condition(conditions, ConditionType.READY, FALSE, "PoolTooSmall", "1/2", 2, T1)
    assert ready.last_transition_time == T0
    assert (ready.reason, ready.message, ready.observed_generation) == ("PoolTooSmall", "1/2", 2)


def test_a_status_flip_moves_the_transition_time():
    conditions = set_condition([], ConditionType.READY, FALSE, "PodsStarting", "", 1, T0)
    (ready,) = set_condition(conditions, ConditionType.READY, TRUE, "Serving", "", 1, T1)
    assert ready.last_transition_time == T1


def test_other_conditions_are_kept_in_place():
    conditions = set_condition([], ConditionType.READY, FALSE, "PodsStarting", "", 1, T0)
    conditions = set_condition(conditions, ConditionType.CANARY_PASSED, TRUE, "Passed", "", 1, T0)
    conditions = set_condition(conditions, ConditionType.READY, TRUE, "Serving", "", 2, T1)
    assert [c.type for c in conditions] == ["Ready", "CanaryPassed"]
    canary = find_condition(conditions, ConditionType.CANARY_PASSED)
    assert canary is not None and canary.last_transition_time == T0
    assert canary.observed_generation == 1


def test_the_input_list_is_not_modified():
    conditions = set_condition([], ConditionType.READY, FALSE, "PodsStarting", "", 1, T0)
    before = list(conditions)
    set_condition(conditions, ConditionType.READY, TRUE, "Serving", "", 1, T1)
    assert conditions == before


def test_times_are_whole_seconds_in_utc():
    local = datetime(2026, 11, 29, 14, 0, 0, 123456, tzinfo=timezone(timedelta(hours=1)))
    (ready,) = set_condition([], ConditionType.READY, TRUE, "Serving", "", 1, local)
    assert ready.last_transition_time == datetime(2026, 11, 29, 13, 0, 0, tzinfo=UTC)


def test_a_naive_time_is_refused():
    with pytest.raises(ValueError, match="timezone-aware"):
        set_condition([], ConditionType.READY, TRUE, "Serving", "", 1, datetime(2026, 1, 1))


def test_a_reason_that_is_not_camel_case_is_refused():
    with pytest.raises(ValueError, match="reason"):
        set_condition([], ConditionType.READY, TRUE, "pool too small", "", 1, T0)


def test_written_status_is_valid_against_the_crd_and_fills_the_printer_columns():
    conditions = set_condition([], ConditionType.READY, TRUE, "Serving", "ok", 3, T0)
    conditions = set_condition(
        conditions, ConditionType.POOL_SUFFICIENT, TRUE, "PoolHoldsContext", "", 3, T0
    )
    status = InferenceDeploymentStatus(
        observed_generation=3,
        conditions=conditions,
        context_length={"requested": 4096, "effective": 4096},
        pools=[{"pod": "p-0", "role": "decode", "revision": "abc", "pool_tokens": 8192}],
        min_pool_tokens=8192,
        prefill=RoleReplicas(ready=1, desired=1),
        decode=RoleReplicas(ready=2, desired=2),
        revision={"current": "abc"},
        canary={"revision": "abc", "job": "x-abc-canary", "result": "Passed"},
        endpoint="http://x.default.svc:8000",
    )
    written = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert written["conditions"][0]["lastTransitionTime"] == "2026-11-29T12:00:00Z"
    manifest = {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "x"},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "contextLength": 4096,
            "router": {"apiKeysSecret": "k"},
        },
        "status": written,
    }
    assert crd_admission().refusals(manifest) == []
    assert written["prefill"]["summary"] == "1/1"
    assert written["decode"]["summary"] == "2/2"
