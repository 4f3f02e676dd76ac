"""A stopping leader gives up its Lease only after the pass kopf left running (issue 26): on
SIGTERM kopf cancels the task that awaits a sync timer, not the thread that runs it, and
`kopf.run` returns while the pass still writes; the Lease released then let the next leader
start beside it, two writers on one object."""

import argparse
import threading
import time
from typing import Any

import kopf
import pytest

from helpers.reconciling import body, run_timer
from kvfence_cli.main import build_parser
from kvfence_operator.app import command
from kvfence_operator.app.in_flight import PassesInFlight
from kvfence_operator.app.metrics import PassMetrics
from kvfence_operator.cluster import kube, leader
from kvfence_operator.reconcile.reconciler import Outcome


def test_idle_waits_for_the_passes_running():
    passes = PassesInFlight()
    assert passes.idle(0)
    entered, leave = threading.Event(), threading.Event()

    def one_pass() -> None:
        with passes.running():
            entered.set()
            leave.wait(5)

    thread = threading.Thread(target=one_pass)
    thread.start()
    entered.wait(5)
    assert not passes.idle(0.05)
    leave.set()
    assert passes.idle(5)
    thread.join()


class SlowReconciler:
    """A pass that takes `seconds`, noting when it ended."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.ended = seconds, 0.0
        self.started = threading.Event()

    def reconcile(self, _body: Any) -> Outcome:
        self.started.set()
        time.sleep(self.seconds)
        self.ended = time.monotonic()
        raise RuntimeError("the pass ends")  # its outcome is not the subject


class Lease:
    released_at = 0.0

    def __init__(self, *_: Any) -> None:
        pass

    def campaign(self, liveness: str | None = None) -> "Lease":
        return self

    def keep(self) -> None:
        pass

    def release(self) -> None:
        Lease.released_at = time.monotonic()


@pytest.mark.parametrize("waits", [True, False], ids=["waits", "negative-control"])
def test_sigterm_releases_the_lease_after_the_running_pass(monkeypatch, waits):
    slow = SlowReconciler(1.0)

    def kopf_run(memo: kopf.Memo, **_: Any) -> None:
        """What kopf.run does on SIGTERM with a pass in its thread pool: it returns."""
        memo.reconciler, memo.metrics = slow, PassMetrics()

        def timer() -> None:
            with pytest.raises(RuntimeError):
                run_timer(memo, body())

        threading.Thread(target=timer, daemon=True).start()
        slow.started.wait(5)

    monkeypatch.setattr(kopf, "run", kopf_run)
    monkeypatch.setattr(kube, "load_cluster_config", lambda: None)
    monkeypatch.setattr(leader, "Election", Lease)
    if not waits:
        monkeypatch.setattr(PassesInFlight, "idle", lambda self, timeout: True)
    args: argparse.Namespace = build_parser().parse_args(["operator", "--leader-elect"])
    assert command.run_operator(args) == 0
    if waits:
        assert Lease.released_at >= slow.ended > 0
    else:
        assert Lease.released_at < slow.ended or slow.ended == 0
