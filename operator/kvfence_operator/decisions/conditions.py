"""metav1.Condition bookkeeping. Status is written with a merge patch, which replaces lists
whole, so the operator always writes the full list this helper returns."""

from collections.abc import Sequence
from datetime import UTC, datetime

from kvfence_operator.crd.types import Condition, ConditionStatus, ConditionType


def find_condition(conditions: Sequence[Condition], type_: ConditionType | str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def set_condition(
    conditions: Sequence[Condition],
    type_: ConditionType | str,
    status: ConditionStatus,
    reason: str,
    message: str,
    observed_generation: int,
    now: datetime | None = None,
) -> list[Condition]:
    """Return the list with one condition added or replaced, in place of the old one.

    lastTransitionTime moves only when status flips: a new reason or message for the same
    status is an update, not a transition.
    """
    now = now or datetime.now(UTC)
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (Kubernetes times are UTC)")
    old = find_condition(conditions, type_)
    if old is not None and old.status == status:
        transitioned_at = old.last_transition_time
    else:
        transitioned_at = now.astimezone(UTC).replace(microsecond=0)  # metav1.Time: seconds
    new = Condition(
        type=str(type_),
        status=status,
        reason=reason,
        message=message,
        last_transition_time=transitioned_at,
        observed_generation=observed_generation,
    )
    if old is None:
        return [*conditions, new]
    return [new if c is old else c for c in conditions]
