"""spec.autoscaling through the operator, end to end (issue 29): `kvfence operator` against the
test cluster, every pod a real process with builtin:tiny-random on CPU, the load real streams
through the router. Decode pods have one slot each (--max-num-seqs 1): two streaming clients
are twice the RunningSequences target, so decode scales to 2 in place (the same revision, no
second canary); when one client stops, the idle pod is drained out of the router first and the
replicas go back to 1, while the other client's streams go on, none failing."""

import threading
from typing import Any

import openai
import pytest

from helpers.tiny_infd import (
    events,
    infd,
    revision_of_manifest,
    routed_to,
    router_client,
    wait_condition,
    with_max_num_seqs,
)
from helpers.waits import READY_S
from kvfence_devcluster.fixtures import Cluster

SCALING = {
    "decode": {
        "minReplicas": 1,
        "maxReplicas": 2,
        "signal": "RunningSequences",
        "target": 1,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 5,
    }
}


class Streams:
    """A client streaming completions one after another until stopped; what failed."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                finish = None
                for chunk in self.client.completions.create(
                    model="tiny-random", prompt="a long story", max_tokens=48,
                    temperature=0, stream=True,
                ):  # fmt: skip
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                if finish is None:
                    self.failures.append("a stream ended without a finish_reason")
                self.done += 1
            except openai.OpenAIError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(60)


def decode_replicas(cluster: Cluster, revision: str) -> int:
    deployment = cluster.require("Deployment", f"tiny-{revision}-decode")
    return int(deployment["spec"]["replicas"])


def scaling_status(cluster: Cluster) -> dict[str, Any]:
    return dict(((infd(cluster).get("status") or {}).get("autoscaling") or {}).get("decode") or {})


@pytest.mark.usefixtures("operator")
def test_decode_follows_the_streams_up_and_drains_back_down_without_a_failed_stream(cluster):
    created = cluster.create(with_max_num_seqs("1", autoscaling=SCALING))
    revision = revision_of_manifest(created)
    wait_condition(cluster, "Ready", "True", timeout=READY_S)
    assert decode_replicas(cluster, revision) == 1

    steady, extra = (Streams(router_client(cluster, revision)) for _ in range(2))
    try:
        cluster.wait_for(
            lambda: len(routed_to(cluster, revision)["decode"]),
            "decode to scale to 2 and the router to route to both",
            timeout=READY_S,
            until=lambda routed: routed == 2,
        )
        assert decode_replicas(cluster, revision) == 2
        [scaled] = [e for e in events(cluster, "Scaled") if "decode: 1 -> 2" in e["message"]]
        assert "RunningSequences" in scaled["message"] and "target 1" in scaled["message"]
        status = infd(cluster)["status"]
        assert status["revision"] == {"current": revision}  # in place: no rollout
        assert len(cluster.list("Job", "default", {"app.kubernetes.io/instance": "tiny"})) == 1
        assert status["autoscaling"]["decode"]["current"] == 2

        extra.finish()  # half the load goes: one decode pod drains, then goes
        cluster.wait_for(
            lambda: decode_replicas(cluster, revision),
            "decode to drain back to 1",
            timeout=READY_S,
            until=lambda replicas: replicas == 1,
        )
        cluster.wait_for(
            lambda: routed_to(cluster, revision)["decode"],
            "the router to route to the one decode pod left",
            until=lambda routed: len(routed) == 1,
        )
        served = steady.done
        cluster.wait_for(lambda: steady.done >= served + 3, "the steady client to go on")
    finally:
        steady.finish()
        extra.finish()
    assert steady.failures == [] and extra.failures == []
    [draining] = events(cluster, "Draining")
    assert "left the routers' backends for the scale-down to 1" in draining["message"]
    assert scaling_status(cluster)["desired"] == 1
    assert wait_condition(cluster, "Ready", "True", timeout=10)
