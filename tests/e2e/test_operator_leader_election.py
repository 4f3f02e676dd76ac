"""Two `kvfence operator --leader-elect` replicas on the test cluster (issue #15 item 2): only
the Lease's holder reconciles; killed mid-rollout, the standby takes the Lease once it has
expired and finishes the rollout; a leader that cannot renew stops at once; a stopped leader
hands the Lease over without the wait. The rollout runs on hollow pods
(kvfence_devcluster/hollow.py): what is tested is who writes, not what the engines serve."""

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest

from helpers.tiny_infd import (
    api_keys_secret,
    check_first_rollout,
    engine_pods,
    hollow_canary_flags,
    infd,
    manifest,
    revision_of_manifest,
    selector_for,
    update_spec,
    wait_promoted,
    with_max_num_seqs,
)
from helpers.waits import READY_S
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_devcluster.processes import ManagedProcess
from kvfence_engine.tools.localproc import free_port
from kvfence_operator.cluster.leader import LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD
from kvfence_operator.crd.types import Role

LEASE = "kvfence-operator"
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
# kopf's log line for each pass of the reconcile timer (kvfence_operator/app/handlers.py).
RECONCILED = "Timer 'reconcile' succeeded"


def start_replica(cluster: Cluster, pod: str, *args: str) -> ManagedProcess:
    env = {"KVFENCE_RECONCILE_INTERVAL": "1", "OPERATOR_NAMESPACE": "default", "POD_NAME": pod}
    return cluster.start_operator(["--leader-elect", "--namespace", "default", *args], env=env)


def holder(cluster: Cluster) -> str | None:
    lease = cluster.get("Lease", LEASE, api_version="coordination.k8s.io/v1")
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


def wait_holder(cluster: Cluster, pod: str, timeout: float = READY_S) -> float:
    """Seconds until `pod` holds the Lease."""
    started = time.monotonic()
    cluster.wait_for(
        lambda: holder(cluster),
        f"{pod} to hold the Lease",
        timeout,
        until=lambda found: found == pod,
    )
    return time.monotonic() - started


def wait_standing_by(cluster: Cluster, replica: ManagedProcess) -> None:
    cluster.wait_for(
        replica.log, "the second replica to stand by", READY_S, until=lambda log: "stands by" in log
    )


@pytest.mark.slow
@pytest.mark.hollow
def test_killing_the_leader_mid_rollout_hands_over_within_the_lease_and_the_standby_finishes_it(
    tmp_path: Path,
) -> None:
    second = with_max_num_seqs("32")
    r2 = revision_of_manifest(second)
    release = tmp_path / "let-the-canary-finish"  # r2's canary holds its verdict until then
    held = hollow_canary_flags(r2, lambda: ["--hollow-wait-for", str(release)])
    with start_cluster(
        tmp_path / "cluster", kubelet=KubeletOptions(hollow=True, amend_argv=held)
    ) as cluster:
        leader_killed_mid_rollout(cluster, second, r2, release)


def leader_killed_mid_rollout(
    cluster: Cluster, second: dict[str, Any], r2: str, release: Path
) -> None:
    cluster.create(api_keys_secret())
    a = start_replica(cluster, "operator-a")
    wait_holder(cluster, "operator-a")
    b = start_replica(cluster, "operator-b")
    wait_standing_by(cluster, b)

    first = cluster.create(manifest())
    r1 = revision_of_manifest(first)
    check_first_rollout(cluster, first, r1)

    # A rollout: r2 comes up beside r1; while its canary runs, kill the leader.
    update_spec(cluster, second["spec"])
    cluster.wait_for(
        lambda: infd(cluster)["status"]["revision"],
        "status to record the rollout",
        until=lambda revision: revision == {"current": r1, "candidate": r2},
    )
    # No double writes: while both run, only the Lease's holder runs kopf at all.
    assert holder(cluster) == "operator-a"
    assert RECONCILED in a.log()
    assert "kopf" not in b.log() and RECONCILED not in b.log(), b.log()

    cluster.wait_for(
        lambda: cluster.list("Pod", "default", selector_for(r2, Role.CANARY)),
        "the candidate's canary to run",
        until=lambda pods: [p["status"].get("phase") for p in pods] == ["Running"],
    )
    a.kill()  # SIGKILL: no release, the standby has to wait the Lease out
    handover = wait_holder(cluster, "operator-b", timeout=LEASE_DURATION + 120)  # a hang guard
    # Not before the Lease expired (the last renewal was at most a retry period before the
    # kill, -1 s for the clocks' reads): a loaded machine only makes the handover later, and
    # how much later is no property of the election.
    assert handover > LEASE_DURATION - RETRY_PERIOD - 1, handover
    assert infd(cluster)["status"]["revision"] == {"current": r1, "candidate": r2}

    release.touch()  # the canary passes now, and only the new leader can promote r2

    wait_promoted(cluster, r2, "the standby to promote the new revision")
    assert len(engine_pods(cluster, r2)) == 2
    assert RECONCILED in b.log()
    assert b.poll() is None


def test_a_leader_that_cannot_renew_stops_at_once_with_one_line(cluster: Cluster) -> None:
    a = start_replica(cluster, "operator-a")
    wait_holder(cluster, "operator-a")
    cluster.wait_for(a.log, "kopf to run", READY_S, until=lambda log: "kopf" in log)

    async def refuse_lease_writes() -> None:
        cluster.server["put", LEASES] << 500

    cluster.loop.run(refuse_lease_writes())
    cluster.wait_for(  # a hang guard
        a.poll, "the leader to exit", RENEW_DEADLINE + 120, until=lambda c: c is not None
    )
    assert a.poll() == 1
    last = a.log().strip().splitlines()[-1]
    assert last.startswith("kvfence operator: lost leadership: lease default/kvfence-operator "), (
        last
    )
    # It stops before a standby could take the Lease (leaseDuration after the last renewal): a
    # latency property, and the margin is the product's (leaseDuration - renewDeadline, 5 s),
    # not 10 times a typical figure. It is read from the leader's own measure, from the start
    # of its last renewal to its exit, with nothing after (os._exit): how late this test saw
    # the exit is the test's scheduling, not the leader's.
    late = re.search(r"not renewed for ([0-9.]+) s \(renew deadline", last)
    # (printed to a tenth: 10.04 s past a 10 s deadline reads 10.0)
    assert late and RENEW_DEADLINE - 0.05 <= float(late[1]) < LEASE_DURATION, last
    assert "Traceback" not in a.log()


def test_a_lease_taken_by_another_stops_the_leader_at_once(cluster: Cluster) -> None:
    a = start_replica(cluster, "operator-a")
    wait_holder(cluster, "operator-a")
    lease = cluster.get("Lease", LEASE, api_version="coordination.k8s.io/v1")
    assert lease is not None
    lease["spec"]["holderIdentity"] = "someone-else"
    cluster.replace(lease)
    cluster.wait_for(a.poll, "the leader to exit", RETRY_PERIOD + 10, until=lambda c: c is not None)
    assert a.poll() == 1
    assert "lost leadership: lease default/kvfence-operator is held by someone-else" in a.log()


def test_a_stopped_leader_releases_the_lease_and_a_standby_answers_liveness_meanwhile(
    cluster: Cluster,
) -> None:
    a = start_replica(cluster, "operator-a")
    wait_holder(cluster, "operator-a")
    port = free_port()
    liveness = f"http://127.0.0.1:{port}/healthz"
    b = start_replica(cluster, "operator-b", "--liveness", liveness)
    wait_standing_by(cluster, b)
    answer: Any = httpx.get(liveness, timeout=5)
    assert answer.status_code == 200, answer.text

    stopping = time.monotonic()
    assert a.stop(grace=20) == 0
    lease = cluster.get("Lease", LEASE, api_version="coordination.k8s.io/v1")
    assert lease is not None and not lease["spec"].get("holderIdentity"), lease
    # Released: no waiting out the lease, the standby takes it at its next try. A latency
    # property: waited out, the handover comes no sooner than leaseDuration after a's last
    # renewal, at most a retry period before the stop began; released, a few seconds after.
    wait_holder(cluster, "operator-b", timeout=LEASE_DURATION + 120)  # a hang guard
    handover = time.monotonic() - stopping
    assert handover < LEASE_DURATION - RETRY_PERIOD, handover
    # Now kopf serves the liveness URL.
    cluster.wait_for(
        lambda: httpx.get(liveness, timeout=5).status_code,
        "kopf's liveness",
        READY_S,
        until=lambda code: code == 200,
    )
    assert b.stop(grace=20) == 0


def test_a_standby_stops_on_sigterm(cluster: Cluster) -> None:
    a = start_replica(cluster, "operator-a")
    wait_holder(cluster, "operator-a")
    b = start_replica(cluster, "operator-b")
    wait_standing_by(cluster, b)
    assert b.stop(grace=10) == 0
    assert holder(cluster) == "operator-a"
    assert a.poll() is None


def test_a_standby_whose_lease_reads_hang_still_stops_on_sigterm(cluster: Cluster) -> None:
    """A Lease GET that never answers (a partition that drops packets) ends (within half the
    renew deadline): the standby then sees SIGTERM, instead of waiting on it forever. The exit
    status is the fact: a standby still waiting when the grace (a hang guard) ends is killed."""
    a = start_replica(cluster, "operator-a")
    wait_holder(cluster, "operator-a")
    b = start_replica(cluster, "operator-b")
    wait_standing_by(cluster, b)

    async def hang_lease_reads() -> None:
        cluster.server["get", LEASES] << (lambda: asyncio.sleep(3600))

    cluster.loop.run(hang_lease_reads())
    # A time under test, not passes: the standby tries every retry period, so by then its next
    # Lease GET is under way and hangs (a request that never answers is not counted anywhere).
    time.sleep(RETRY_PERIOD + 1)
    assert b.stop(grace=RENEW_DEADLINE * 6) == 0, b.log()
    assert "Traceback" not in b.log()
    a.kill()  # its renewals hang too: its watchdog would stop it, not what this is about
