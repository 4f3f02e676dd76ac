"""Issue 26: nothing but the candidate's own canary promotes it. Each case runs the real
Reconciler against the in-memory API server (helpers/gate.py): a selector edit, a record
removed from the serving revision, a hand-made canary Job, a failed canary's Job removed."""

import pytest

from helpers.gate import INSTANCE, Gate, serving_then_rolling
from kvfence_operator.meta import (
    LABEL_REVISION,
)

# ---- 1. the Service's selector is not a record -----------------------------------------------


KEYED = pytest.mark.parametrize("key", [b"the credentials key", None], ids=["derived", "legacy"])


@KEYED
def test_a_selector_edited_to_the_candidate_promotes_nothing_and_is_put_back(key):
    gate = Gate(key)
    r1, r2 = serving_then_rolling(gate)
    service = gate.get("Service", INSTANCE.name)
    assert service is not None
    service["spec"]["selector"][LABEL_REVISION] = r2  # kubectl patch svc/tiny
    gate.reconcile()
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert gate.selected() == r1, "the selector edit was not repaired"
    assert gate.routers_open(r1) and not gate.routers_open(r2)
    gate.reconcile(3)
    assert gate.exists(r1), "the serving revision was retired on a selector edit"
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    (warning,) = gate.events_of("SelectorRepaired")
    assert warning.type == "Warning"
    assert r2 in warning.message and r1 in warning.message
    assert not gate.events_of("Promoted")[1:], "the candidate was promoted"


@KEYED
def test_a_lost_status_is_recovered_from_the_operators_own_seal_not_from_the_selector(key):
    """Status wiped mid-rollout: the serving revision comes back from what the operator wrote
    and can verify (its seal on the stable Service), and a selector pointed at the candidate
    alongside does not make the candidate current."""
    gate = Gate(key)
    r1, r2 = serving_then_rolling(gate)
    gate.obj.pop("status")
    gate.reconcile()
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert gate.exists(r1) and gate.selected() == r1

    gate.obj.pop("status")
    service = gate.get("Service", INSTANCE.name)
    assert service is not None
    service["spec"]["selector"][LABEL_REVISION] = r2
    gate.reconcile(2)
    assert gate.status["revision"] == {"current": r1, "candidate": r2}
    assert gate.selected() == r1 and gate.exists(r1) and not gate.routers_open(r2)
