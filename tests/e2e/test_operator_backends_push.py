"""The router learns its backends from the operator's push, not from the ConfigMap volume
(issue 14, item 2): on the test cluster, with the kubelet made to refresh ConfigMap volumes as
late as a real one does (here: not within the test at all), a deleted engine pod leaves the
router's backends within an operator pass or two. On hollow pods (kvfence_devcluster/hollow.py),
whose router takes pushes as the real one does (a real router routing by a push:
tests/integration/test_router_backends_push.py)."""

import base64
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.operators import start_operator
from helpers.tiny_infd import NAME, api_keys_secret, manifest
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_operator.builders.secret import INTERNAL_TOKEN_KEY, secret_name
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import LABEL_REVISION, Instance, child_name
from kvfence_operator.revision import revision_of

LAG = 3600.0  # seconds before a running pod's configMap volume shows a change
PASSES = 2  # the deleted pod leaves the router within this many passes after the deletion


def pushed_manifest() -> dict[str, Any]:
    """Two decode pods (one is deleted), no canary (promotion is not what this is about)."""
    return manifest(
        decode={"replicas": 2, "resources": {"requests": {"cpu": "1"}}},
        canary={"enabled": False},
    )


def pods(cluster: Cluster, revision: str, role: str) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/instance": NAME, LABEL_REVISION: revision}
    return [
        p
        for p in cluster.list("Pod", "default", labels | {"kvfence.dev/role": role})
        if not p["metadata"].get("deletionTimestamp")
    ]


COUNTS = {"router": 1, "prefill": 1, "decode": 2}


def has_ip(pod: dict[str, Any]) -> bool:
    """Scheduled and given its IP: a pod just created has neither yet."""
    return bool((pod.get("status") or {}).get("podIP"))


def in_force(router_url: str, token: str) -> dict[str, Any]:
    r = httpx.get(router_url + "/internal/v1/backends", headers={"X-Kvfence-Internal-Token": token})
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.hollow
def test_a_deleted_engine_pod_leaves_the_routers_backends_without_the_configmap_volume(
    tmp_path: Path,
) -> None:
    options = KubeletOptions(configmap_volume_lag=LAG, hollow=True)
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        cluster.create(api_keys_secret())
        operator = start_operator(cluster)
        created = cluster.create(pushed_manifest())
        revision = revision_of(InferenceDeploymentSpec.model_validate(created["spec"]))
        instance = Instance(NAME, "default", created["metadata"]["uid"])
        secret = cluster.wait_for(
            lambda: cluster.get("Secret", secret_name(instance, revision)),
            "the revision's Secret",
            60,
            until=lambda s: s is not None,
        )
        assert secret is not None
        token = base64.b64decode(secret["data"][INTERNAL_TOKEN_KEY]).decode()

        placed = cluster.wait_for(
            lambda: {role: pods(cluster, revision, role) for role in COUNTS},
            "the router pod, one prefill pod and two decode pods, each with its IP",
            60,
            until=lambda found: all(
                len(found[role]) == n and all(has_ip(p) for p in found[role])
                for role, n in COUNTS.items()
            ),
        )
        (router,) = placed["router"]
        router_url = cluster.pod_url(router)
        wanted = {
            role: sorted(cluster.pod_url(p) for p in placed[role]) for role in ("prefill", "decode")
        }

        held = cluster.wait_for(
            lambda: in_force(router_url, token),  # an error while the router starts: retried
            "the router to hold the prefill pod and both decode pods",
            240,
            until=lambda h: {role: sorted(h["backends"][role]) for role in wanted} == wanted,
            interval=0.5,
        )
        # The router's backends file, as the kubelet last wrote it: it will not change now.
        assert cluster.kubelet is not None  # a cluster with a kubelet: it ran the router
        runtime = cluster.kubelet.runtimes[router["metadata"]["uid"]]
        file = runtime.sandbox.volume_paths["config"] / "backends.json"
        on_disk = json.loads(file.read_text())

        victim = next(p for p in pods(cluster, revision, "decode"))
        victim_url = cluster.pod_url(victim)
        deleted = time.monotonic()
        passes = operator.passes(NAME)
        cluster.delete("Pod", victim["metadata"]["name"])
        after = cluster.wait_for(
            lambda: in_force(router_url, token),
            "the deleted decode pod to leave the router's backends",
            60,
            until=lambda h: victim_url not in h["backends"]["decode"],
            interval=0.2,
        )
        took = operator.passes(NAME) - passes
        print(f"left the router's backends {time.monotonic() - deleted:.1f} s after deletion")
        # the pass under way at the deletion may not have seen it; the next one pushes
        assert took <= PASSES, f"{took} passes"
        assert after["source"] == "push"
        assert after["backends"]["version"] > held["backends"]["version"]
        # the ConfigMap changed, the volume did not: the push did it
        assert json.loads(file.read_text()) == on_disk
        configmap = cluster.get("ConfigMap", child_name(instance, revision, Role.ROUTER))
        assert configmap is not None
        assert victim_url not in json.loads(configmap["data"]["backends.json"])["decode"]

        # and it routes to the decode pod that is left (and, once it runs, its successor)
        (left,) = [p for p in placed["decode"] if p["metadata"]["uid"] != victim["metadata"]["uid"]]
        assert cluster.pod_url(left) in after["backends"]["decode"]
        operator.stop()
