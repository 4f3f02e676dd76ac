"""What the operator pushes to routers (router_push): the version of a backends set, which pods
may be given to a router or pushed to, and that a push failure never fails the pass."""

import logging
from typing import Any

import pytest

from kvfence_engine.contracts import BackendsFile
from kvfence_engine.tools.localproc import free_port
from kvfence_operator.router_push import may_serve, push_backends, versioned, written_backends

WANTED = BackendsFile(revision="r1", context_length=1024, prefill=["http://p"], decode=["http://d"])
NOW_MS = 1_800_000_000_000


def test_an_unchanged_set_keeps_its_version_and_a_changed_one_gets_a_newer_one() -> None:
    written = WANTED.model_copy(update={"version": NOW_MS - 5000})
    assert versioned(WANTED, written, NOW_MS).version == NOW_MS - 5000  # nothing to push
    changed = WANTED.model_copy(update={"decode": []})
    assert versioned(changed, written, NOW_MS).version == NOW_MS
    # a clock behind the written version (a skewed node): still newer than what was written
    assert versioned(changed, written, NOW_MS - 10_000).version == NOW_MS - 4999
    # no ConfigMap yet, or one whose file does not read: starts from the clock
    assert versioned(WANTED, None, NOW_MS).version == NOW_MS
    assert versioned(WANTED, written_backends("not json"), NOW_MS).version == NOW_MS
    assert written_backends(written.file_text()) == written
    assert written_backends(None) is None


def pod(phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": "10.0.0.9"}}


def test_a_deleting_evicted_or_finished_pod_is_never_given_to_a_router() -> None:
    assert may_serve(pod()) and may_serve(pod("Pending"))
    assert not may_serve(pod(deleting=True))
    assert not may_serve(pod("Failed"))  # evicted: its IP may be another pod's now
    assert not may_serve(pod("Succeeded"))


def test_a_router_that_cannot_be_reached_is_logged_and_the_pass_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, "kvfence_operator.router_push"):
        push_backends([dead], WANTED, "token")
        push_backends([dead], WANTED, None)
    assert f"backends not pushed to router {dead}" in caplog.text
    assert "backends of revision r1 not pushed: no internal token" in caplog.text
