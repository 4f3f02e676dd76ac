"""What `kubectl get/describe infd` says on an evaluator's first day (issue 34 items 3, 4, 7;
issue 26 item 11), end to end: `kvfence operator` on the emulated cluster, read with the real
`kubectl`, on hollow pods (kvfence_devcluster/hollow.py: they answer what the operator asks,
fail with the engine's own words for a model path that does not exist and size their pools
with the engine's arithmetic). What is tested is what the operator says, not what engines
serve.

- a model path that is not in the container: every engine pod crash-loops, and the status says
  so, `Degraded=True EngineCrashLooping` with the engine's message, and one Event;
- a pool too small: `Stalled=True PoolInsufficient` and one `PoolInsufficient` Event;
- a healthy start is no Warning, and a rollout keeps `Ready=True` while the old revision
  serves, with `Progressing=True`.
"""

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.operators import Operator, start_operator
from helpers.tiny_infd import (
    NAME,
    api_keys_secret,
    condition,
    engine_pods,
    hollow_canary_flags,
    manifest,
    revision_of_manifest,
    with_max_num_seqs,
)
from helpers.waits import READY_S
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.options import KubeletOptions

pytestmark = pytest.mark.hollow


def applied(cluster: Cluster, tmp_path: Path, obj: dict[str, Any]) -> None:
    path = tmp_path / "infd.json"
    path.write_text(json.dumps(obj))
    out = cluster.kubectl("apply", "-f", str(path)).stdout.strip()
    assert out.startswith(f"inferencedeployment.kvfence.dev/{NAME} "), out


def infd(cluster: Cluster) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "infd", NAME, "-o", "json").stdout)


def wait_for_condition(cluster: Cluster, kind: str, status: str, reason: str) -> dict[str, Any]:
    def holds(obj: dict[str, Any]) -> bool:
        c = condition(obj, kind)
        return (c.get("status"), c.get("reason")) == (status, reason)

    return cluster.wait_for(
        lambda: infd(cluster), f"{kind}={status} {reason}", timeout=READY_S, until=holds
    )


def events(cluster: Cluster, reason: str | None = None) -> list[dict[str, Any]]:
    listed = json.loads(cluster.kubectl("get", "events", "-o", "json").stdout)["items"]
    return [e for e in listed if reason is None or e.get("reason") == reason]


def described_events(cluster: Cluster) -> str:
    return cluster.kubectl("describe", "infd", NAME).stdout.split("\nEvents:", 1)[1]


def restarts(cluster: Cluster, revision: str) -> int:
    return min(
        int(s.get("restartCount") or 0)
        for pod in engine_pods(cluster, revision)
        for s in (pod.get("status") or {}).get("containerStatuses") or []
    )


def test_a_model_path_not_in_the_container_is_engine_crash_looping_in_its_words_once(
    cluster: Cluster, operator: Operator, tmp_path: Path
) -> None:
    broken = manifest(model={"source": "/models/tiny.gguf"})
    revision = revision_of_manifest(broken)
    applied(cluster, tmp_path, broken)
    degraded = wait_for_condition(cluster, "Degraded", "True", "EngineCrashLooping")
    said = condition(degraded, "Degraded")["message"]
    assert said.startswith(f"revision {revision}: its engine pods crash-loop"), said
    assert "cannot load model '/models/tiny.gguf': no such file" in said, said
    assert "expected one of" not in said
    assert condition(degraded, "Ready")["status"] == "False"

    # more restarts and passes: the same words, one Event, and no Warning for the pods
    cluster.wait_for(lambda: restarts(cluster, revision), "two restarts of each engine",
                     timeout=READY_S, until=lambda n: n >= 2)  # fmt: skip
    operator.wait_passes(3, NAME)
    assert condition(infd(cluster), "Degraded")["message"] == said
    (event,) = events(cluster, "EngineCrashLooping")
    assert event["type"] == "Warning" and event["message"] == said
    assert event["involvedObject"]["name"] == NAME
    assert events(cluster, "PoolUnknown") == [], "a pod that never started is no PoolUnknown"
    assert "EngineCrashLooping" in described_events(cluster)


def test_a_pool_too_small_is_stalled_with_one_pool_insufficient_event(
    cluster: Cluster, operator: Operator, tmp_path: Path
) -> None:
    small = manifest(contextLength=2048)  # ENOUGH holds 1536 tokens of tiny-random KV
    applied(cluster, tmp_path, small)
    stalled = wait_for_condition(cluster, "Stalled", "True", "PoolInsufficient")
    said = condition(stalled, "Stalled")["message"]
    assert "smaller than contextLength 2048" in said, said
    assert "raise kvCacheMemory by 34% or lower contextLength to 1536" in said, said
    cluster.wait_for(lambda: events(cluster, "PoolInsufficient"), "the PoolInsufficient Event")
    operator.wait_passes(3, NAME)
    (event,) = events(cluster, "PoolInsufficient")
    assert event["type"] == "Warning" and event["message"] == said
    # the revision's refusal, said once: no Warning per pod, none for pods starting
    assert [e["reason"] for e in events(cluster) if e["type"] == "Warning"] == ["PoolInsufficient"]
    assert "PoolInsufficient" in described_events(cluster)


def test_a_healthy_start_is_no_warning_and_a_rollout_keeps_ready_while_the_old_revision_serves(
    tmp_path: Path,
) -> None:
    changed = with_max_num_seqs("16")
    r2 = revision_of_manifest(changed)
    release = tmp_path / "release-canary"
    options = KubeletOptions(
        hollow=True,
        amend_argv=hollow_canary_flags(r2, lambda: ["--hollow-wait-for", str(release)]),
    )
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        cluster.create(api_keys_secret())
        operator = start_operator(cluster)
        first = manifest()
        r1 = revision_of_manifest(first)
        applied(cluster, tmp_path, first)
        cluster.kubectl("wait", "--for=condition=Ready", f"infd/{NAME}", "--timeout=240s",
                        timeout=260)  # fmt: skip
        warnings = [e for e in events(cluster) if e["type"] == "Warning"]
        assert warnings == [], "a healthy start is no Warning"
        assert {e["reason"] for e in events(cluster)} >= {"PoolHoldsContext", "Promoted"}

        applied(cluster, tmp_path, changed)
        seen: list[tuple[str, str, str]] = []

        def canary_running() -> dict[str, Any]:
            obj = infd(cluster)
            ready = condition(obj, "Ready")
            seen.append(
                (str(ready.get("status")), str(ready.get("reason")), str(ready.get("message")))
            )
            return obj

        during = cluster.wait_for(
            canary_running,
            "the candidate's canary running",
            timeout=READY_S,
            until=lambda o: (
                (o["status"].get("canary") or {}).get("result") == "Running"
                and (o["status"].get("canary") or {}).get("revision") == r2
            ),
        )
        assert condition(during, "Progressing")["reason"] == "RolloutInProgress"
        assert condition(during, "Progressing")["status"] == "True"
        assert condition(during, "Degraded")["status"] == "False"
        ready = condition(during, "Ready")
        assert (ready["status"], ready["reason"]) == ("True", "Serving")
        assert f"revision {r1} serves" in ready["message"]
        assert f"revision {r2} is rolling out" in ready["message"]
        # `kubectl wait` on Ready answers while the old revision serves (the candidate's canary
        # is held until the release below: Ready cannot turn True meanwhile; 60 s: a guard)
        cluster.kubectl("wait", "--for=condition=Ready", f"infd/{NAME}", "--timeout=60s")

        release.write_text("go")
        cluster.wait_for(
            canary_running,
            "the candidate promoted",
            timeout=READY_S,
            until=lambda o: (
                o["status"]["revision"].get("current") == r2
                and condition(o, "Progressing").get("status") == "False"
            ),
        )
        assert all(status == "True" for status, _, _ in seen), [s for s in seen if s[0] != "True"]
        warnings = [e for e in events(cluster) if e["type"] == "Warning"]
        assert warnings == [], warnings
        operator.stop()
        assert not cluster.problems()
