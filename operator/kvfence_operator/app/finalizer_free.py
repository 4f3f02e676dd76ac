"""The reconcile timer without kopf's finalizer, so that nothing is stuck once the operator is
gone (`helm uninstall`): an InferenceDeployment with a finalizer nobody removes stays in
Terminating, and so do its namespace and the CRD.

The operator has nothing to do when an InferenceDeployment is deleted: every child carries an
ownerReference and goes with the garbage collector. kopf puts a finalizer on every object a
timer runs for (`@kopf.timer` registers its handler with requires_finalizer=True, and there
is no setting for it) only to learn of the deletion and stop the timer. Here the timer is
registered without it, and the watch tells of the deletion instead: a DELETED event marks the
object's uid, the timer's `when` filter stops matching it, and kopf stops a timer whose
filter no longer matches (daemons.match_daemons) in that same event's processing. A pass
already running creates nothing more (the reconciler asks `deletion_reported` before each
create); what it created just before names a gone owner, and the garbage collector removes
it. Objects that still carry the finalizer from an older operator lose it on their next
event: kopf removes its finalizer when no handler requires it.

Left open: a deletion the watch never reports (the stream expired with 410 Gone across it and
kopf listed afresh) leaves that object's timer running until the operator restarts; what it
creates then names a gone owner, and the garbage collector removes it."""

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import kopf

Fn = TypeVar("Fn", bound=Callable[..., Any])
DELETED_UIDS = "deleted_uids"  # the memo field: uids the watch reported DELETED


def remember_deletions(memo: kopf.Memo) -> None:
    """At startup, in the operator's memo: every object's memo is a shallow copy of it, so
    the one set is shared by the event handler and the timers' filter."""
    setattr(memo, DELETED_UIDS, set())


def not_deleted(uid: str, memo: kopf.Memo, **_: Any) -> bool:
    """The timer's `when` filter."""
    return uid not in getattr(memo, DELETED_UIDS, ())


def deletion_reported(memo: kopf.Memo) -> Callable[[str], bool]:
    """Whether the watch has reported this uid DELETED: for code that runs outside a kopf
    handler (the reconciler asks it before each create)."""
    return getattr(memo, DELETED_UIDS).__contains__


def mark_deleted(type: str, uid: str, memo: kopf.Memo, **_: Any) -> None:
    """A low-level kopf.on.event handler (those need no finalizer); `type` is kopf's name
    for the watch event's type."""
    if type == "DELETED":
        getattr(memo, DELETED_UIDS).add(uid)


def without_finalizer(fn: Fn) -> Fn:
    """Applied above `@kopf.timer(...)`: the timer kopf just registered for `fn` no longer
    asks for a finalizer. Its `when` must include `not_deleted`."""
    handlers = kopf.get_default_registry()._spawning._handlers
    for index, handler in enumerate(handlers):
        if handler.fn is fn:
            if handler.when is None:
                raise TypeError(f"{fn.__name__}: a timer without a finalizer needs not_deleted")
            handlers[index] = dataclasses.replace(handler, requires_finalizer=False)
            return fn
    raise LookupError(f"{fn.__name__} is not a registered kopf timer")
