"""The test cluster (devcluster/, package kvfence_devcluster) behaves like Kubernetes where
the operator's end-to-end tests depend on it: API server semantics kmock lacks, a kubelet that
runs pods as real local processes, and kopf running against it."""

import base64
import itertools
import json
import sys
import textwrap
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client, watch

from kvfence_devcluster import store as store_module
from kvfence_devcluster.controllers import POD_DELETION_COST, Controllers
from kvfence_devcluster.fixtures import Cluster, ClusterApiError, start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_devcluster.resources import ResourceType
from kvfence_devcluster.sandbox import VENV_BIN
from kvfence_devcluster.store import MERGE_PATCH, Store
from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_operator.builders.engine_deployment import (
    build_engine_deployment,
    build_engine_service,
)
from kvfence_operator.builders.secret import RevisionCredentials, build_revision_secret
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import KV_POOL_GATE, Instance, selector
from kvfence_operator.revision import revision_of

GROUP, VERSION, PLURAL = "kvfence.dev", "v1alpha1", "inferencedeployments"
PYTHON = sys.executable


def inference_deployment(name: str, context_length: int = 512) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "contextLength": context_length,
            "router": {"apiKeysSecret": f"{name}-keys"},
        },
    }


def config_map(name: str, labels: dict[str, str] | None = None, /, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels or {}},
        "data": data,
    }


def owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    ref = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
    }
    obj["metadata"]["ownerReferences"] = [{**ref, "controller": True, "blockOwnerDeletion": True}]
    return obj


def rv(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


# ---- API server ---------------------------------------------------------------------------


def test_create_answers_201_and_fills_in_what_the_api_server_owns(cluster: Cluster):
    body = inference_deployment("alpha")  # no namespace: it comes from the URL
    response = cluster.request(
        "POST", f"/apis/{GROUP}/{VERSION}/namespaces/team-a/{PLURAL}", json=body
    )
    assert response.status_code == 201
    created = response.json()
    meta = created["metadata"]
    assert meta["namespace"] == "team-a"
    assert len(meta["uid"]) == 36 and meta["creationTimestamp"].endswith("Z")
    assert meta["generation"] == 1
    configmap = cluster.create(config_map("plain", a="1"))
    assert rv(configmap) > rv(created), "resourceVersion is one counter bumped on every write"
    assert "generation" not in configmap["metadata"], "ConfigMaps have no generation"
    assert (
        cluster.require("InferenceDeployment", "alpha", "team-a")["metadata"]["uid"] == meta["uid"]
    )
    # The official client maps 201 to the object (kmock's 200 made this None).
    objects = client.CustomObjectsApi(cluster.api_client)
    made = objects.create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, inference_deployment("beta")
    )
    assert isinstance(made, dict), made  # a custom resource has no model: its JSON object
    assert made["metadata"]["namespace"] == "default"


def test_duplicate_create_is_409_and_a_missing_object_is_404(cluster: Cluster):
    cluster.create(config_map("once"))
    core = client.CoreV1Api(cluster.api_client)
    with pytest.raises(client.ApiException) as duplicate:
        core.create_namespaced_config_map(
            "default", client.V1ConfigMap.model_validate(config_map("once"))
        )
    assert duplicate.value.status == 409 and duplicate.value.body is not None
    assert json.loads(duplicate.value.body)["reason"] == "AlreadyExists"
    with pytest.raises(client.ApiException) as missing:
        core.read_namespaced_config_map("never", "default")
    assert missing.value.status == 404
    assert cluster.delete("ConfigMap", "never") is False


def test_a_dry_run_create_answers_like_a_create_and_stores_nothing(cluster: Cluster):
    """How the operator asks whether a Secret exists without the right to read it."""
    core = client.CoreV1Api(cluster.api_client)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys"}}
    made = core.create_namespaced_secret(
        "default", client.V1Secret.model_validate(secret), dry_run="All"
    )
    assert made.metadata is not None and made.metadata.name == "keys"
    assert cluster.get("Secret", "keys") is None
    cluster.create(secret)
    with pytest.raises(client.ApiException) as taken:
        core.create_namespaced_secret(
            "default", client.V1Secret.model_validate(secret), dry_run="All"
        )
    assert taken.value.status == 409


def test_spec_changes_bump_generation_status_and_metadata_changes_do_not(cluster: Cluster):
    created = cluster.create(inference_deployment("gen"))
    respec = cluster.patch("InferenceDeployment", "gen", {"spec": {"contextLength": 1024}})
    assert respec["metadata"]["generation"] == 2 and rv(respec) > rv(created)
    labelled = cluster.patch("InferenceDeployment", "gen", {"metadata": {"labels": {"a": "b"}}})
    assert labelled["metadata"]["generation"] == 2 and rv(labelled) > rv(respec)
    status = cluster.patch(
        "InferenceDeployment", "gen", {"status": {"observedGeneration": 2}}, subresource="status"
    )
    assert status["metadata"]["generation"] == 2 and rv(status) > rv(labelled)
    again = cluster.patch("InferenceDeployment", "gen", {"spec": {"contextLength": 1024}})
    assert rv(again) == rv(status), "a patch that changes nothing writes nothing"
    deployment = cluster.create(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "idle"},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": "idle"}},
                "template": {
                    "metadata": {"labels": {"app": "idle"}},
                    "spec": {"containers": [{"name": "c", "image": "none", "command": ["true"]}]},
                },
            },
        }
    )
    scaled = cluster.patch("Deployment", "idle", {"spec": {"replicas": 0, "paused": True}})
    assert deployment["metadata"]["generation"] == 1 and scaled["metadata"]["generation"] == 2


def test_status_subresource_keeps_status_and_the_rest_apart(cluster: Cluster):
    cluster.create(inference_deployment("split"))
    main = cluster.patch(
        "InferenceDeployment", "split", {"spec": {"contextLength": 2048}, "status": {"x": 1}}
    )
    assert "status" not in main, "a main-resource patch ignores status"
    status = cluster.patch(
        "InferenceDeployment",
        "split",
        {"spec": {"contextLength": 1}, "status": {"x": 2}},
        subresource="status",
    )
    assert status["status"] == {"x": 2} and status["spec"]["contextLength"] == 2048
    replaced = cluster.replace(
        {**status, "spec": {**status["spec"], "contextLength": 4096}, "status": {"x": 3}}
    )
    assert replaced["spec"]["contextLength"] == 4096 and replaced["status"] == {"x": 2}
    objects = client.CustomObjectsApi(cluster.api_client)
    via_client = objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "split", {"status": {"x": 4}}
    )
    assert isinstance(via_client, dict), via_client
    assert via_client["status"] == {"x": 4}


def test_writes_guarded_by_a_stale_resource_version_are_refused(cluster: Cluster):
    created = cluster.create(config_map("guarded", a="1"))
    stale = created["metadata"]["resourceVersion"]
    cluster.patch("ConfigMap", "guarded", {"data": {"a": "2"}})
    # The operator's pods/status patches carry metadata.resourceVersion: stale is 409.
    with pytest.raises(ClusterApiError) as merge:
        cluster.patch(
            "ConfigMap", "guarded", {"metadata": {"resourceVersion": stale}, "data": {"a": "3"}}
        )
    assert merge.value.status == 409
    # kopf's JSON patches start with a `test` of resourceVersion: stale is 422.
    test_stale = {"op": "test", "path": "/metadata/resourceVersion", "value": stale}
    with pytest.raises(ClusterApiError) as json_patch:
        cluster.patch(
            "ConfigMap",
            "guarded",
            [test_stale, {"op": "remove", "path": "/data/a"}],
            patch_type="json",
        )
    assert json_patch.value.status == 422
    assert cluster.require("ConfigMap", "guarded")["data"] == {"a": "2"}


def test_the_official_clients_strategic_merge_patches_merge_keyed_lists(cluster: Cluster):
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "svc", "finalizers": ["a"]},
        "spec": {"selector": {"app": "x"}, "ports": [{"name": "http", "port": 8000}]},
    }
    created = cluster.create(service)
    assert created["spec"]["ports"][0]["targetPort"] == 8000, "defaulted like the API server"
    core = client.CoreV1Api(cluster.api_client)
    patch = {"metadata": {"finalizers": ["b"]}, "spec": {"ports": [{"name": "t", "port": 8001}]}}
    patched = core.patch_namespaced_service("svc", "default", patch)  # strategic merge patch
    assert patched.spec is not None and patched.metadata is not None
    assert [p.port for p in patched.spec.ports or []] == [8000, 8001]
    assert patched.metadata.finalizers == ["a", "b"]
    objects = client.CustomObjectsApi(cluster.api_client)
    cluster.create(inference_deployment("crd"))
    response = cluster.request(
        "PATCH",
        f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}/crd",
        content=b"{}",
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )
    assert response.status_code == 415, "custom resources take no strategic merge patches"
    assert objects.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "crd")


def test_label_and_field_selectors_filter_lists(cluster: Cluster):
    cluster.create(config_map("a", {"tier": "gold", "role": "prefill"}))
    cluster.create(config_map("b", {"tier": "silver", "role": "decode"}))
    cluster.create(config_map("c", {"tier": "gold"}))

    def names(**kwargs: Any) -> list[str]:
        return [o["metadata"]["name"] for o in cluster.list("ConfigMap", "default", **kwargs)]

    assert names(labels={"tier": "gold"}) == ["a", "c"]
    assert names(labels="tier!=gold") == ["b"]
    assert names(labels="role in (prefill,decode),tier notin (silver)") == ["a"]
    assert names(labels="!role") == ["c"]
    assert names(labels="role") == ["a", "b"]
    assert names(fields="metadata.name=b") == ["b"]
    assert names(labels={"tier": "bronze"}) == []


def test_watch_delivers_added_modified_deleted_after_a_resource_version(cluster: Cluster):
    core = client.CoreV1Api(cluster.api_client)
    cluster.create(config_map("before", {"w": "yes"}))
    listed = core.list_namespaced_config_map("default", label_selector="w=yes")
    assert listed.metadata is not None
    since = listed.metadata.resource_version
    assert since is not None
    cluster.create(config_map("watched", {"w": "yes"}))
    cluster.create(config_map("ignored", {"w": "no"}))
    cluster.patch("ConfigMap", "watched", {"data": {"k": "v"}})
    cluster.patch(
        "ConfigMap", "watched", {"metadata": {"labels": {"w": "no"}}}
    )  # leaves the selection
    cluster.delete("ConfigMap", "before")
    events = list(
        watch.Watch().stream(
            core.list_namespaced_config_map,
            "default",
            label_selector="w=yes",
            resource_version=since,
            timeout_seconds=1,
        )
    )
    seen = [(e["type"], e["object"].metadata.name) for e in events]
    assert seen == [
        ("ADDED", "watched"),
        ("MODIFIED", "watched"),
        ("DELETED", "watched"),
        ("DELETED", "before"),
    ]
    versions = [int(e["object"].metadata.resource_version) for e in events]
    assert versions == sorted(versions) and versions[0] > int(since)


def test_deleting_an_owner_collects_its_dependents_transitively(cluster: Cluster):
    owner = cluster.create(inference_deployment("owner"))
    child = cluster.create(owned_by(config_map("child"), owner))
    grandchild = cluster.create(
        owned_by(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "grandchild"},
                "stringData": {"k": "v"},
            },
            child,
        )
    )
    assert grandchild["data"] == {"k": "dg=="}, "stringData is stored base64-encoded in data"
    cluster.create(config_map("bystander"))
    held = cluster.create(owned_by(config_map("held"), owner))
    cluster.patch("ConfigMap", "held", {"metadata": {"finalizers": ["test.kvfence.dev/hold"]}})
    assert cluster.delete("InferenceDeployment", "owner")
    assert cluster.get("InferenceDeployment", "owner") is None
    assert cluster.get("ConfigMap", "child") is None and cluster.get("Secret", "grandchild") is None
    assert cluster.get("ConfigMap", "bystander") is not None
    terminating = cluster.require("ConfigMap", "held")
    assert terminating["metadata"]["deletionTimestamp"], "a finalizer holds it, marked for deletion"
    cluster.patch("ConfigMap", "held", {"metadata": {"finalizers": None}})
    assert cluster.get("ConfigMap", "held") is None and held

    orphan_owner = cluster.create(inference_deployment("orphaning"))
    cluster.create(owned_by(config_map("orphan"), orphan_owner))
    cluster.delete("InferenceDeployment", "orphaning", propagation="Orphan")
    assert cluster.require("ConfigMap", "orphan")["metadata"]["ownerReferences"] == []


def test_a_dependent_written_after_its_owner_was_deleted_is_collected(cluster: Cluster):
    """A controller's write that races the owner's deletion (a reconcile in flight when the
    owner goes) names a gone uid; a real garbage collector deletes it, so does the test one."""
    owner = cluster.create(inference_deployment("gone"))
    late = owned_by(config_map("late"), owner)
    assert cluster.delete("InferenceDeployment", "gone")
    cluster.create(late)
    living = cluster.create(inference_deployment("living"))
    both = owned_by(config_map("shared"), living)
    both["metadata"]["ownerReferences"].append(late["metadata"]["ownerReferences"][0])
    cluster.create(both)
    cluster.create(config_map("unowned"))
    cluster.wait_for(lambda: cluster.get("ConfigMap", "late"), "the late dependent to go",
                     until=lambda found: found is None)  # fmt: skip
    assert cluster.get("ConfigMap", "shared") is not None, "one owner still exists"
    assert cluster.get("ConfigMap", "unowned") is not None


# ---- kubelet --------------------------------------------------------------------------------

# A web server whose port comes from a --port flag, as `kvfence serve` takes it.
WEB_SERVER = (
    "import http.server as h, sys; port = int(sys.argv[sys.argv.index('--port') + 1]); "
    "h.HTTPServer(('127.0.0.1', port), h.SimpleHTTPRequestHandler).serve_forever()"
)


def web_deployment(name: str, replicas: int) -> dict[str, Any]:
    container = {
        "name": "web",
        "image": "python:3.11",
        "command": ["python", "-c", WEB_SERVER],
        "args": ["--port", "8080"],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 5},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [container]},
            },
        },
    }


def test_an_evicted_pod_is_stopped_replaced_and_left_until_deleted(cluster: Cluster):
    """As a node's kubelet evicts (phase Failed, reason Evicted, through pods/status) and the
    ReplicaSet controller then replaces the pod, leaving the finished one to pod GC."""
    cluster.create(web_deployment("web", replicas=1))
    first = cluster.wait_for(
        lambda: only_pod(cluster, app="web"),
        "a ready pod",
        until=lambda p: (cluster.pod_condition(p, "Ready") or {}).get("status") == "True",
    )
    url = cluster.pod_url(first)
    evicted = {"phase": "Failed", "reason": "Evicted", "message": "low on memory", "podIP": None}
    cluster.patch("Pod", first["metadata"]["name"], {"status": evicted}, subresource="status")
    cluster.wait_for(
        lambda: answers(url), "the evicted pod's server to stop", until=lambda up: not up
    )

    def ready_replacement() -> dict[str, Any] | None:
        pods = cluster.list("Pod", "default", labels={"app": "web"})
        others = [p for p in pods if p["metadata"]["name"] != first["metadata"]["name"]]
        ready = [
            p for p in others if (cluster.pod_condition(p, "Ready") or {}).get("status") == "True"
        ]
        return ready[0] if len(pods) == 2 and len(ready) == 1 else None

    cluster.wait_for(ready_replacement, "a ready replacement beside the evicted pod")
    left = cluster.get("Pod", first["metadata"]["name"])
    assert left is not None and left["status"]["phase"] == "Failed"
    assert left["status"]["reason"] == "Evicted" and not left["status"].get("podIP")
    cluster.wait_for(  # the Deployment controller counts the replacement on its next tick
        lambda: cluster.require("Deployment", "web")["status"],
        "the Deployment to count its ready replacement",
        until=lambda status: status.get("readyReplicas") == status.get("replicas") == 1,
    )


def job(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "python:3.11", "command": command}
    pod_spec = {"restartPolicy": "Never", "containers": [container], **spec.pop("pod", {})}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": {"spec": pod_spec}, **spec},
    }


def job_condition(cluster: Cluster, name: str) -> dict[str, Any] | None:
    found = cluster.get("Job", name)
    return next(
        (
            c
            for c in (found or {}).get("status", {}).get("conditions", [])
            if c["type"] in ("Complete", "Failed") and c["status"] == "True"
        ),
        None,
    )


def condition_of(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    found = [c for c in (obj or {}).get("status", {}).get("conditions", []) if c["type"] == kind]
    return found[0] if found else {}


def only_pod(cluster: Cluster, **labels: str) -> dict[str, Any]:
    """The one pod with these labels; LookupError unless there is exactly one (in a wait, an
    observation to retry)."""
    pods = cluster.list("Pod", "default", labels=labels)
    if len(pods) != 1:
        raise LookupError(f"{len(pods)} pods labelled {labels}, not one")
    return pods[0]


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def container_pid(pod: dict[str, Any]) -> int:
    return int(pod["status"]["containerStatuses"][0]["containerID"].rsplit("/", 1)[1])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_deployment_keeps_its_replicas_and_replaces_pods_when_its_template_changes(
    cluster: Cluster,
):
    cluster.create(web_deployment("web", replicas=2))
    deployment = cluster.wait_for(
        lambda: cluster.require("Deployment", "web"),
        "2 ready replicas",
        until=lambda d: d["status"].get("readyReplicas") == 2,
    )
    assert deployment["status"]["observedGeneration"] == 1
    pods = cluster.list("Pod", "default", labels={"app": "web"})
    urls = {cluster.pod_url(pod) for pod in pods}
    assert len(urls) == 2, "each pod has its own port"
    assert all(answers(url) for url in urls)
    for pod in pods:
        (owner,) = pod["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("Deployment", "web", True)
        assert pod["metadata"]["name"].startswith(
            f"web-{pod['metadata']['labels']['pod-template-hash']}-"
        )

    cluster.patch("Deployment", "web", {"spec": {"replicas": 1}})
    remaining = cluster.wait_for(lambda: only_pod(cluster, app="web"), "one pod left")
    stopped = (urls - {cluster.pod_url(remaining)}).pop()
    cluster.wait_for(
        lambda: answers(stopped), "the surplus pod's server to stop", until=lambda up: not up
    )

    template = {"spec": {"template": {"metadata": {"annotations": {"restarted": "1"}}}}}
    patched = cluster.patch("Deployment", "web", template)
    replaced = cluster.wait_for(
        lambda: only_pod(cluster, app="web"),
        "the pod to be replaced after a template change",
        until=lambda p: (
            p["metadata"]["name"] != remaining["metadata"]["name"]
            and cluster.require_condition(p, "Ready")["status"] == "True"
        ),
    )
    assert replaced["metadata"]["annotations"] == {"restarted": "1"}
    cluster.wait_for(  # the controller writes status on its next tick, not with the pod
        lambda: cluster.require("Deployment", "web")["status"],
        "observedGeneration to catch up and the replacement to be counted ready",
        until=lambda s: (
            s["observedGeneration"] == patched["metadata"]["generation"] == 3
            and s.get("readyReplicas") == 1
        ),
    )


def scaled_down_from_3_to_2(
    monkeypatch: pytest.MonkeyPatch, ready: list[bool], costs: list[str | None]
) -> list[int]:
    """The emulator's Deployment controller on a bare Store (no process): a Deployment's 3 pods,
    oldest first, with these Ready conditions and pod-deletion-cost annotations, scaled to 2.
    The indexes of the pods it deleted."""
    stamps = (f"2024-01-01T00:00:{s:02d}Z" for s in itertools.count())
    monkeypatch.setattr(store_module, "now_rfc3339", lambda: next(stamps))
    store = Store()

    def resource_type(group: str, version: str, plural: str) -> ResourceType:
        kind = plural.removesuffix("s").capitalize()
        return ResourceType(group, version, plural, kind, True, frozenset({"status"}))

    controllers = Controllers(store, resource_type)
    deployment = web_deployment("web", replicas=3)
    store.create(controllers.deployments, "default", deployment)
    controllers.reconcile()
    pods = sorted(
        store.list_objects(controllers.pods), key=lambda p: p["metadata"]["creationTimestamp"]
    )
    assert len(pods) == 3
    merge = partial(store.patch, controllers.pods, "default", content_type=MERGE_PATCH)
    for pod, is_ready, cost in zip(pods, ready, costs, strict=True):
        name = pod["metadata"]["name"]
        if is_ready:
            ready_condition = {"type": "Ready", "status": "True"}
            merge(name, {"status": {"conditions": [ready_condition]}}, subresource="status")
        if cost is not None:
            merge(name, {"metadata": {"annotations": {POD_DELETION_COST: cost}}})
    store.update(controllers.deployments, "default", "web", lambda d: d["spec"].update(replicas=2))
    controllers.reconcile()
    left = {p["metadata"]["name"] for p in store.list_objects(controllers.pods)}
    return [i for i, pod in enumerate(pods) if pod["metadata"]["name"] not in left]


def test_a_scale_down_deletes_the_pod_of_lowest_deletion_cost_not_the_newest(
    monkeypatch: pytest.MonkeyPatch,
):
    assert scaled_down_from_3_to_2(monkeypatch, [True] * 3, [None, None, None]) == [2]
    assert scaled_down_from_3_to_2(monkeypatch, [True] * 3, [None, "-100", None]) == [1]


def test_a_scale_down_deletes_a_not_ready_pod_before_a_ready_one_of_lower_cost(
    monkeypatch: pytest.MonkeyPatch,
):
    deleted = scaled_down_from_3_to_2(monkeypatch, [False, True, True], ["100", "-100", None])
    assert deleted == [0]


def test_a_container_that_exits_is_restarted_with_its_exit_code_recorded(cluster: Cluster):
    crashing = web_deployment("crash", replicas=1)
    container = crashing["spec"]["template"]["spec"]["containers"][0]
    container["command"] = ["python", "-c", "import sys; print('bye'); sys.exit(5)"]
    cluster.create(crashing)
    pod = cluster.wait_for(
        lambda: only_pod(cluster, app="crash"),
        "two restarts",
        until=lambda p: p["status"]["containerStatuses"][0]["restartCount"] >= 2,
    )
    status = pod["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 5
    assert status["lastState"]["terminated"]["reason"] == "Error"
    assert pod["status"]["phase"] == "Running" and status["ready"] is False
    name = pod["metadata"]["name"]
    core = client.CoreV1Api(cluster.api_client)
    assert core.read_namespaced_pod_log(name, "default").count("bye") >= 2
    cluster.delete("Deployment", "crash")
    cluster.wait_gone("Pod", name)
    assert cluster.pod_log(name).count("bye") >= 2, "logs outlive the pod, for diagnosis"


def test_a_container_failing_its_liveness_probe_is_stopped_and_restarted(cluster: Cluster):
    """The spec's own timings: two failures a second apart, then SIGTERM (http.server dies of
    it: 143) and a restart; a container whose probe passes is left alone."""
    for name, path in (("unhealthy", "/missing"), ("healthy", "/")):
        deployment = web_deployment(name, replicas=1)
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        container["livenessProbe"] = {
            "httpGet": {"path": path, "port": "http"},  # http.server: 404 for /missing
            "periodSeconds": 1,
            "failureThreshold": 2,
        }
        cluster.create(deployment)
    pod = cluster.wait_for(
        lambda: only_pod(cluster, app="unhealthy"),
        "a restart",
        until=lambda p: p["status"]["containerStatuses"][0]["restartCount"] >= 1,
    )
    terminated = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (143, "Error")
    assert "liveness probe failed 2 times in a row" in cluster.pod_log(pod["metadata"]["name"])
    healthy = only_pod(cluster, app="healthy")
    assert healthy is not None
    assert healthy["status"]["containerStatuses"][0]["restartCount"] == 0


def test_a_failed_job_reports_the_termination_message(cluster: Cluster):
    script = "echo 'marker leaked to tenant B' > /dev/termination-log; exit 3"
    cluster.create(job("leaky", ["sh", "-c", script]))
    failed = cluster.wait_for(lambda: job_condition(cluster, "leaky"), "the Job to finish")
    assert (failed["type"], failed["reason"]) == ("Failed", "BackoffLimitExceeded")
    status = cluster.require("Job", "leaky")["status"]
    assert status["failed"] == 1 and "succeeded" not in status and "completionTime" not in status
    pod = only_pod(cluster, **{"job-name": "leaky"})
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    assert terminated["message"] == "marker leaked to tenant B\n"
    assert pod["status"]["phase"] == "Failed"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "Job"


def test_a_job_past_its_active_deadline_is_killed_and_fails(cluster: Cluster):
    # 5 s: time for the pod to start, even on a loaded machine
    cluster.create(job("slow", ["sleep", "60"], activeDeadlineSeconds=5))
    running = cluster.wait_for(
        lambda: only_pod(cluster, **{"job-name": "slow"}),
        "the Job's pod to run",
        until=lambda p: "running" in p["status"]["containerStatuses"][0]["state"],
    )
    pid = container_pid(running)
    failed = cluster.wait_for(lambda: job_condition(cluster, "slow"), "the deadline to pass")
    assert (failed["type"], failed["reason"]) == ("Failed", "DeadlineExceeded")
    assert failed["message"] == "Job was active longer than specified deadline"
    cluster.wait_for(lambda: alive(pid), "the pod's process to be killed", until=lambda up: not up)


def finished_runs(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    """The terminated states of a Job's pods, in the order they ran."""
    pods = cluster.list("Pod", "default", labels={"job-name": name})
    runs = [p["status"]["containerStatuses"][0]["state"].get("terminated") for p in pods]
    assert all(runs), runs
    return sorted(runs, key=lambda r: r["startedAt"])


def stamp(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def test_a_job_retries_counted_failures_with_exponential_backoff_up_to_its_limit(
    cluster: Cluster,
):
    cluster.create(job("flaky", ["sh", "-c", "exit 2"], backoffLimit=2))
    failed = cluster.wait_for(lambda: job_condition(cluster, "flaky"), "the Job to give up")
    assert (failed["type"], failed["reason"]) == ("Failed", "BackoffLimitExceeded")
    assert failed["message"] == "Job has reached the specified backoff limit"
    assert cluster.require("Job", "flaky")["status"]["failed"] == 3
    runs = finished_runs(cluster, "flaky")
    assert len(runs) == 3, "backoffLimit 2: the first try and two retries"
    assert [r["exitCode"] for r in runs] == [2, 2, 2]
    gaps = [stamp(b["startedAt"]) - stamp(a["finishedAt"]) for a, b in itertools.pairwise(runs)]
    assert gaps[0] >= 1 and gaps[1] >= 2, f"1 s, then 2 s between tries: {gaps}"


def test_pod_failure_policy_fails_a_job_at_once_on_a_matching_exit_code(cluster: Cluster):
    finding = {
        "action": "FailJob",
        "onExitCodes": {"containerName": "main", "operator": "In", "values": [1]},
    }
    cluster.create(
        job(
            "finding", ["sh", "-c", "exit 1"], backoffLimit=3, podFailurePolicy={"rules": [finding]}
        )
    )
    unexpected = {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [2]}}
    cluster.create(
        job(
            "unexpected",
            ["sh", "-c", "exit 7"],
            backoffLimit=3,
            podFailurePolicy={"rules": [unexpected]},
        )
    )
    for name, code in (("finding", 1), ("unexpected", 7)):
        failed = cluster.wait_for(partial(job_condition, cluster, name), f"{name} to fail")
        assert (failed["type"], failed["reason"]) == ("Failed", "PodFailurePolicy")
        (pod,) = cluster.list("Pod", "default", labels={"job-name": name})
        assert failed["message"] == (
            f"Container main for pod default/{pod['metadata']['name']} failed with exit code "
            f"{code} matching FailJob rule at index 0"
        )
        target = condition_of(cluster.get("Job", name), "FailureTarget")
        assert target["reason"] == "PodFailurePolicy"
        assert cluster.require("Job", name)["status"]["failed"] == 1


def test_a_pod_failure_ignored_by_its_condition_is_not_counted_and_the_job_runs_again(
    cluster: Cluster, tmp_path
):
    go, tried = tmp_path / "go", tmp_path / "tried"
    script = (
        f"[ -e {tried} ] && exit 0; touch {tried}; until [ -e {go} ]; do sleep 0.1; done; exit 3"
    )
    disrupted = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    cluster.create(
        job(
            "evicted", ["sh", "-c", script], backoffLimit=0, podFailurePolicy={"rules": [disrupted]}
        )
    )
    first = cluster.wait_for(
        lambda: only_pod(cluster, **{"job-name": "evicted"}),
        "the first pod to run",
        until=lambda p: "running" in p["status"]["containerStatuses"][0]["state"],
    )
    name = first["metadata"]["name"]
    eviction = {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": "EvictionByEvictionAPI",
        "message": "Eviction API: evicting",
    }
    cluster.patch(
        "Pod",
        name,
        {"status": {"conditions": [eviction]}},
        subresource="status",
        patch_type="strategic",
    )
    go.touch()
    done = cluster.wait_for(lambda: job_condition(cluster, "evicted"), "the Job to finish")
    assert done["type"] == "Complete", done
    status = cluster.require("Job", "evicted")["status"]
    assert status["succeeded"] == 1 and "failed" not in status, status
    evicted = cluster.require("Pod", name)
    assert evicted["status"]["phase"] == "Failed"
    kept = cluster.pod_condition(evicted, "DisruptionTarget")
    assert kept is not None and kept["status"] == "True", "the kubelet leaves it alone"


def test_mounted_files_and_environment_follow_configmaps_and_secrets(cluster: Cluster):
    cluster.create(config_map("backends", **{"backends.json": "v1"}))
    cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds"},
            "stringData": {"token": "s3cret", "keys": "KEY tenant\n"},
        }
    )
    # Waits until the mounted file says v2, then reports what it saw.
    script = textwrap.dedent(
        """
        import sys, time
        args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
        while open(args["--file"]).read() != "v2":
            time.sleep(0.05)
        keys = open(args["--keys"]).read().strip()
        open(args["--report"], "w").write(f"{args['--who']}|{args['--token']}|{keys}")
        """
    )
    container = {
        "name": "main",
        "image": "python:3.11",
        "command": ["python", "-c", script],
        "args": [
            "--file",
            "/etc/kvfence/backends.json",
            "--keys",
            "/var/run/kvfence/api-keys/tenants",
            "--who",
            "$(POD_NAME)",
            "--token",
            "$(TOKEN)",
            "--report",
            "/dev/termination-log",
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        ],
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/kvfence"},
            {"name": "credentials", "mountPath": "/var/run/kvfence"},
        ],
    }
    volumes = [
        {"name": "config", "configMap": {"name": "backends"}},
        {
            "name": "credentials",
            "projected": {
                "defaultMode": 0o440,
                "sources": [
                    {
                        "secret": {
                            "name": "creds",
                            "items": [{"key": "keys", "path": "api-keys/tenants"}],
                        }
                    }
                ],
            },
        },
    ]
    manifest = job("reader", [], pod={"containers": [container], "volumes": volumes})
    cluster.create(manifest)
    pod = cluster.wait_for(
        lambda: only_pod(cluster, **{"job-name": "reader"}),
        "the reader to start",
        until=lambda p: "running" in p["status"]["containerStatuses"][0]["state"],
    )
    assert job_condition(cluster, "reader") is None, "it must still be waiting for v2"
    cluster.patch("ConfigMap", "backends", {"data": {"backends.json": "v2"}})
    done = cluster.wait_for(lambda: job_condition(cluster, "reader"), "the reader to see v2")
    assert done["type"] == "Complete"
    finished = cluster.require("Pod", pod["metadata"]["name"])
    message = finished["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    assert message == f"{pod['metadata']['name']}|s3cret|KEY tenant"
    assert finished["status"]["phase"] == "Succeeded"


def test_a_configmap_volume_can_lag_its_configmap_like_the_real_kubelets(tmp_path: Path):
    """KubeletOptions.configmap_volume_lag: a running pod's configMap files change that long
    after the ConfigMap does (the real kubelet: its sync period, about a minute); a Secret's
    files and a new pod's files are not held back."""
    lag = 3.0
    with start_cluster(tmp_path / "cluster", kubelet=KubeletOptions(configmap_volume_lag=lag)) as c:
        c.create(config_map("lagging", **{"backends.json": "v1"}))
        c.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "creds"},
                "stringData": {"token": "t1"},
            }
        )
        volumes = [
            {"name": "config", "configMap": {"name": "lagging"}},
            {"name": "creds", "secret": {"secretName": "creds"}},
        ]
        mounts = [
            {"name": "config", "mountPath": "/etc/kvfence"},
            {"name": "creds", "mountPath": "/var/run/creds"},
        ]
        pod_spec = {"containers": [{"name": "main", "image": "python:3.11",
                                    "command": ["sleep", "60"], "volumeMounts": mounts}],
                    "volumes": volumes}  # fmt: skip
        c.create(job("holder", [], pod=pod_spec))
        pod = c.wait_for(
            lambda: only_pod(c, **{"job-name": "holder"}),
            "the pod to run",
            until=lambda p: "running" in p["status"]["containerStatuses"][0]["state"],
        )
        assert c.kubelet is not None
        paths = c.kubelet.runtimes[pod["metadata"]["uid"]].sandbox.volume_paths
        config, token = paths["config"] / "backends.json", paths["creds"] / "token"
        assert (config.read_text(), token.read_text()) == ("v1", "t1")
        changed = time.monotonic()
        c.patch("ConfigMap", "lagging", {"data": {"backends.json": "v2"}})
        c.patch("Secret", "creds", {"data": {"token": base64.b64encode(b"t2").decode()}})
        c.wait_for(token.read_text, "the Secret's file to change", until=lambda t: t == "t2")
        assert config.read_text() == "v1", "the ConfigMap's file must lag"
        c.wait_for(config.read_text, "the ConfigMap's file to change", until=lambda t: t == "v2")
        assert time.monotonic() - changed >= lag


# ---- the operator's own manifests, and kopf -------------------------------------------------

TINY_SPEC = {
    "model": {"source": "builtin:tiny-random"},
    "engine": {"kvCacheMemory": "4Mi"},
    "contextLength": 512,
    "decode": {"replicas": 1, "resources": {"requests": {"cpu": "1"}}},
    "router": {"apiKeysSecret": "tiny-keys"},
}
# What the canary Job does first: reach a revision's Service by its cluster DNS name.
SERVICE_PROBE = (
    "import sys, urllib.request; url = sys.argv[sys.argv.index('--target') + 1]; print(url); "
    "sys.exit(0 if urllib.request.urlopen(url + '/readyz').status == 200 else 1)"
)


def set_pool_gate(cluster: Cluster, pod: dict[str, Any], status: str) -> dict[str, Any]:
    """What the operator does: write the whole condition list (merge patch replaces lists),
    guarded by the resourceVersion it read."""
    gate = {"type": KV_POOL_GATE, "status": status, "reason": "PoolChecked", "message": "test"}
    others = [c for c in pod["status"]["conditions"] if c["type"] != KV_POOL_GATE]
    patch = {
        "metadata": {"resourceVersion": pod["metadata"]["resourceVersion"]},
        "status": {"conditions": [*others, gate]},
    }
    return cluster.patch("Pod", pod["metadata"]["name"], patch, subresource="status")


def test_engine_pods_from_the_operators_builders_serve_and_are_ready_only_past_the_pool_gate(
    cluster: Cluster,
):
    spec = InferenceDeploymentSpec.model_validate(TINY_SPEC)
    owner = cluster.create(
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceDeployment",
            "metadata": {"name": "tiny"},
            "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
    )
    instance = Instance("tiny", "default", owner["metadata"]["uid"])
    revision = revision_of(spec)
    credentials = RevisionCredentials.generate()
    cluster.create(build_revision_secret(instance, revision, credentials))
    deployment = build_engine_deployment(spec, instance, revision, Role.DECODE)
    cluster.create(deployment)
    service = cluster.create(build_engine_service(instance, revision, Role.DECODE))
    pod = cluster.wait_for(
        lambda: only_pod(cluster, **selector(instance, revision, Role.DECODE)),
        "the decode engine's container to be ready",
        timeout=120,
        until=lambda p: p["status"].get("containerStatuses", [{}])[0].get("ready"),
    )
    url = cluster.pod_url(pod)
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert pod["status"]["podIP"] == "127.0.0.1" and 8000 not in ports.values()
    assert httpx.get(url + "/readyz").status_code == 200
    assert httpx.get(url + "/v1/kvpool").status_code == 401  # the Secret's token guards it
    token = {TOKEN_HEADER: credentials.internal_token}
    pool = httpx.get(url + "/v1/kvpool", headers=token).json()
    assert (pool["role"], pool["revision"]) == ("decode", revision)
    assert pool["transfer_port"] == ports["transfer"], "--transfer-port follows the pod's port"
    assert cluster.require_condition(pod, "ContainersReady")["status"] == "True"
    not_ready = cluster.require_condition(pod, "Ready")
    assert (not_ready["status"], not_ready.get("reason")) == ("False", "ReadinessGatesNotReady")
    assert KV_POOL_GATE in not_ready["message"]
    assert (
        cluster.require("Deployment", deployment["metadata"]["name"])["status"].get("readyReplicas")
        is None
    )

    def gate_true() -> dict[str, Any]:
        current = cluster.require("Pod", pod["metadata"]["name"])
        if cluster.pod_condition(current, KV_POOL_GATE) is None:
            current = set_pool_gate(cluster, current, "True")  # 409 if the kubelet wrote first
        return current

    ready = cluster.wait_for(
        gate_true,
        "the pod to be Ready",
        until=lambda p: cluster.require_condition(p, "Ready")["status"] == "True",
    )
    # Ready=True is the kubelet's write, after the gate: the operator's condition survived it.
    assert cluster.require_condition(ready, KV_POOL_GATE)["status"] == "True"
    cluster.wait_for(
        lambda: cluster.require("Deployment", deployment["metadata"]["name"])["status"],
        "the Deployment to count the ready pod",
        until=lambda s: s.get("readyReplicas") == 1,
    )

    target = f"http://{service['metadata']['name']}.default.svc:8000"
    cluster.create(job("reach-service", ["python", "-c", SERVICE_PROBE, "--target", target]))
    done = cluster.wait_for(
        lambda: job_condition(cluster, "reach-service"), "the Job to reach the Service"
    )
    assert done["type"] == "Complete", cluster.describe()
    job_pod = only_pod(cluster, **{"job-name": "reach-service"})
    assert cluster.pod_log(job_pod["metadata"]["name"]).splitlines()[1] == url

    pid = container_pid(pod)
    assert cluster.delete("InferenceDeployment", "tiny")
    cluster.wait_gone("Pod", pod["metadata"]["name"])
    assert cluster.get("Deployment", deployment["metadata"]["name"]) is None
    cluster.wait_for(lambda: alive(pid), "the engine process to be killed", until=lambda up: not up)


def test_an_engine_pod_that_cannot_load_its_model_crash_loops_with_the_reason_as_its_message(
    cluster: Cluster,
):
    """Not a Running pod that is never Ready: `kubectl describe pod` says why it cannot start."""
    spec = InferenceDeploymentSpec.model_validate(
        {**TINY_SPEC, "model": {"source": "builtin:tiny-randm"}}
    )
    owner = cluster.create(
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceDeployment",
            "metadata": {"name": "typo"},
            "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
    )
    instance = Instance("typo", "default", owner["metadata"]["uid"])
    revision = revision_of(spec)
    cluster.create(build_revision_secret(instance, revision, RevisionCredentials.generate()))
    cluster.create(build_engine_deployment(spec, instance, revision, Role.DECODE))
    pod = cluster.wait_for(
        lambda: only_pod(cluster, **selector(instance, revision, Role.DECODE)),
        "the engine to crash and be restarted",
        timeout=120,
        until=lambda p: p["status"].get("containerStatuses", [{}])[0].get("restartCount"),
    )
    status = pod["status"]["containerStatuses"][0]
    terminated = status["lastState"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (1, "Error")
    assert terminated["message"].startswith(
        "engine failed to start: ValueError: cannot load model 'builtin:tiny-randm'"
    ), terminated["message"]
    assert status["ready"] is False


TINY_OPERATOR = """
import kopf
import kubernetes


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.persistence.finalizer = "test.kvfence.dev/finalizer"
    settings.watching.server_timeout = 10


@kopf.on.create("kvfence.dev", "v1alpha1", "inferencedeployments")
def created(body, name, namespace, patch, **_):
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-child"}}
    kopf.adopt(child)  # needs the uid the API server assigned
    kubernetes.config.load_kube_config()
    kubernetes.client.CoreV1Api().create_namespaced_config_map(namespace, child)
    patch.status["seenBy"] = "tiny-operator"
    kopf.info(body, reason="Seen", message="the tiny operator saw it")


@kopf.on.delete("kvfence.dev", "v1alpha1", "inferencedeployments")
def deleted(**_):
    pass
"""


def test_kopf_handles_an_inference_deployment_and_its_deletion(cluster: Cluster, tmp_path):
    source = tmp_path / "tiny_operator.py"
    source.write_text(TINY_OPERATOR)
    kopf = cluster.start_process(
        [str(VENV_BIN / "kopf"), "run", "--standalone", "-A", "--verbose", str(source)], "kopf"
    )
    cluster.create(inference_deployment("watched"))
    handled = cluster.wait_for(
        lambda: cluster.require("InferenceDeployment", "watched"),
        "kopf to patch status.seenBy",
        until=lambda o: (o.get("status") or {}).get("seenBy") == "tiny-operator",
    )
    assert "test.kvfence.dev/finalizer" in handled["metadata"]["finalizers"]
    child = cluster.require("ConfigMap", "watched-child")
    assert child["metadata"]["ownerReferences"][0]["uid"] == handled["metadata"]["uid"]
    (event,) = cluster.wait_for(
        lambda: [e for e in cluster.list("Event") if e.get("reason") == "Seen"], "kopf's Event"
    )
    assert event["involvedObject"]["uid"] == handled["metadata"]["uid"]
    cluster.delete("InferenceDeployment", "watched")
    cluster.wait_gone("InferenceDeployment", "watched")  # kopf ran on.delete, removed its finalizer
    cluster.wait_gone("ConfigMap", "watched-child")
    kopf.stop()
    assert "Handler 'created' succeeded" in kopf.log()
    assert "Handler 'deleted' succeeded" in kopf.log()


# A web server that, on SIGTERM, says so, finishes for a second and exits 0.
DRAINING_SERVER = (
    "import http.server as h, signal, sys, threading, time\n"
    "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
    "server = h.HTTPServer(('127.0.0.1', port), h.SimpleHTTPRequestHandler)\n"
    "def term(*_):\n"
    "    print('SIGTERM', 'at', time.time(), flush=True)\n"
    "    threading.Thread(target=lambda: (time.sleep(1), print('all', 'drained', flush=True),"
    " server.shutdown())).start()\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "server.serve_forever()\n"
)


def test_a_deleted_pod_leaves_the_service_then_sleeps_its_pre_stop_before_sigterm(tmp_path):
    deployment = web_deployment("drain", replicas=1)
    template = deployment["spec"]["template"]["spec"]
    template["terminationGracePeriodSeconds"] = 20
    template["containers"][0]["command"] = ["python", "-c", DRAINING_SERVER]
    template["containers"][0]["lifecycle"] = {"preStop": {"sleep": {"seconds": 3}}}
    with start_cluster(tmp_path / "cluster", kubelet=KubeletOptions(grace_cap=30)) as cluster:
        cluster.create(deployment)
        service = cluster.create(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "drain"},
                "spec": {"selector": {"app": "drain"}, "ports": [{"port": 80, "targetPort": 8080}]},
            }
        )
        through_service = f"http://{service['spec']['clusterIP']}:80/"
        pod = cluster.wait_for(
            lambda: only_pod(cluster, app="drain"),
            "a ready pod",
            until=lambda _: answers(through_service),
        )
        name, pid = pod["metadata"]["name"], container_pid(pod)
        cluster.delete("Deployment", "drain")
        deleted_at = time.time()
        cluster.wait_gone("Pod", name)
        # out of the Service at once, but still running, and no SIGTERM yet: the preStop sleep
        assert not answers(through_service)
        # a time under test: halfway through the 3 s preStop, still no SIGTERM (a loaded
        # machine may be past it by now: then the lower bound below says it all the same)
        time.sleep(max(0.0, deleted_at + 1.5 - time.time()))
        if time.time() - deleted_at < 2.5:
            assert alive(pid) and "SIGTERM at" not in cluster.pod_log(name)
        cluster.wait_for(lambda: alive(pid), "the pod's process to exit", until=lambda a: not a)
        log = cluster.pod_log(name)
        assert "all drained" in log, log  # it stopped on its own, within the grace period
        term_at = float(log.split("SIGTERM at ", 1)[1].split()[0])
        # after the preStop, and soon after it rather than at the grace period's end (20 s):
        # the upper bound leaves a loaded machine 10 s
        assert 2.5 < term_at - deleted_at < 13, term_at - deleted_at
        assert not cluster.problems()
