"""The real `kubectl` (1.32, on PATH) drives the devcluster's API server: discovery, OpenAPI,
server-side printing, apply (client- and server-side), patch, watch, wait, describe, logs,
delete and errors, each checked in what kubectl prints."""

import base64
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.kubectl_tables import cells
from helpers.waits import eventually
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.resources import ResourceType
from kvfence_devcluster.tables import human_duration

ROOT = Path(__file__).resolve().parents[2]
KIND = "InferenceDeployment"
API_VERSION = "kvfence.dev/v1alpha1"
CRD_COLUMNS = ["NAME", "READY", "CONTEXT", "POOL", "PREFILL", "DECODE", "REVISION", "AGE"]
CRD_WIDE = [*CRD_COLUMNS, "CANARY", "ISOLATION", "CANDIDATE", "C-POOL", "C-PREFILL", "C-DECODE",
            "P-SCALE", "D-SCALE"]  # fmt: skip


def inference_deployment(name: str = "tiny", context_length: int = 512) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "contextLength": context_length,
            "router": {"apiKeysSecret": f"{name}-keys"},
        },
    }


def live_status() -> dict[str, Any]:
    return {
        "conditions": [
            {"type": "Progressing", "status": "False", "reason": "Idle"},
            {"type": "Ready", "status": "True", "reason": "Serving"},
        ],
        "contextLength": {"requested": 512, "effective": 512},
        "minPoolTokens": 1536,
        "prefill": {"ready": 1, "desired": 1, "summary": "1/1"},
        "decode": {"ready": 0, "desired": 2, "summary": "0/2"},
        "revision": {"current": "8d41c2a7e0"},
        "canary": {"result": "Passed"},
    }


def rows(output: str) -> list[list[str]]:
    """kubectl's table split on whitespace (empty cells vanish: for rows without them)."""
    return [line.split() for line in output.strip().splitlines()]


def test_discovery_names_every_kind_once_with_short_names_and_the_server_version(
    cluster: Cluster,
) -> None:
    listed = rows(cluster.kubectl("api-resources", "--no-headers").stdout)
    assert ["inferencedeployments", "infd", API_VERSION, "true", KIND] in listed
    assert ["pods", "po", "v1", "true", "Pod"] in listed
    assert ["namespaces", "ns", "v1", "false", "Namespace"] in listed
    assert ["deployments", "deploy", "apps/v1", "true", "Deployment"] in listed
    assert not [r for r in listed if "/" in r[0]]  # subresources are not kinds

    got = cluster.kubectl("get", "infd", "-v=2")
    assert "could also match" not in got.stderr  # no ambiguous short names
    assert "Server Version: v1.32" in cluster.kubectl("version").stdout


def test_namespaces_are_listed_created_and_used(cluster: Cluster) -> None:
    listed = cells(cluster.kubectl("get", "ns").stdout)
    assert ["default", "Active"] in [row[:2] for row in listed]
    assert "kube-system" in [row[0] for row in listed]

    assert cluster.kubectl("create", "namespace", "team-a").stdout.strip() == (
        "namespace/team-a created"
    )
    cluster.kubectl("create", "configmap", "settings", "-n", "team-a", "--from-literal=a=b")
    assert cluster.require("ConfigMap", "settings", "team-a")["data"] == {"a": "b"}
    assert cells(cluster.kubectl("get", "cm", "-n", "team-a").stdout)[0][:2] == ["settings", "1"]
    assert cluster.require("Namespace", "team-a")["status"]["phase"] == "Active"


def test_get_prints_the_crds_printer_columns_with_live_values(cluster: Cluster) -> None:
    cluster.create(inference_deployment())
    out = cluster.kubectl("get", "infd").stdout
    assert out.splitlines()[0].split() == CRD_COLUMNS
    assert cells(out) == [["tiny", "", "", "", "", "", "", cells(out)[0][-1]]]
    assert cells(out)[0][-1].endswith("s")  # an age, not a timestamp

    cluster.patch(KIND, "tiny", {"status": live_status()}, subresource="status",
                  api_version=API_VERSION)  # fmt: skip
    for args in (("get", "infd"), ("get", "infd", "-o", "wide"), ("get", "infd", "tiny")):
        out = cluster.kubectl(*args).stdout
        wide = "wide" in args
        assert out.splitlines()[0].split() == (CRD_WIDE if wide else CRD_COLUMNS), args
        (row,) = cells(out)
        # Ready is the Ready condition's status (the filter chose it, not Progressing's)
        assert row[:7] == ["tiny", "True", "512", "1536", "1/1", "0/2", "8d41c2a7e0"]
        assert row[7].endswith("s")  # the age
        # -o wide: the priority-1 columns (canary; no standing canary, candidate or autoscaling)
        assert row[8:] == (["Passed", "", "", "", "", "", "", ""] if wide else [])

    names = cluster.kubectl("get", "infd", "-o", "name").stdout.split()
    assert names == ["inferencedeployment.kvfence.dev/tiny"]
    everywhere = cells(cluster.kubectl("get", "infd", "-A").stdout)
    assert everywhere[0][:3] == ["default", "tiny", "True"]


def test_builtin_kinds_get_their_usual_columns_and_pod_logs(cluster: Cluster) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "hello", "labels": {"app": "hello"}},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "python",
                    "command": ["python", "-c",
                                "import time; print('hello from the pod', flush=True); "
                                "time.sleep(600)"],
                    "ports": [{"containerPort": 8080, "name": "http"}],
                }
            ]
        },
    }  # fmt: skip
    service: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "hello"},
        "spec": {"selector": {"app": "hello"}, "ports": [{"port": 8000, "targetPort": "http"}]},
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([pod, service]))
    cluster.kubectl("wait", "--for=condition=Ready", "pod/hello", "--timeout=30s")

    pods = cluster.kubectl("get", "pods").stdout
    assert pods.splitlines()[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert cells(pods)[0][:4] == ["hello", "1/1", "Running", "0"]
    wide = cluster.kubectl("get", "pods", "-o", "wide").stdout.splitlines()[0].split()
    assert wide[5:7] == ["IP", "NODE"]
    assert "hello from the pod" in cluster.kubectl("logs", "hello").stdout

    service["spec"]["ports"][0]["port"] = 8001  # re-applied: kubectl's strategic merge patch
    assert cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(service)).stdout.strip() == (
        "service/hello configured"
    )
    services = cluster.kubectl("get", "svc").stdout
    assert services.splitlines()[0].split() == [
        "NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"
    ]  # fmt: skip
    (row,) = cells(services)
    assert row[0:2] == ["hello", "ClusterIP"] and row[3:5] == ["<none>", "8001/TCP"]

    cluster.kubectl(
        "create", "secret", "generic", "tiny-keys", "--from-literal=api-keys=sk-1 team-a"
    )
    secret = cluster.get("Secret", "tiny-keys")
    assert secret is not None
    assert base64.b64decode(secret["data"]["api-keys"]).decode() == "sk-1 team-a"
    assert cells(cluster.kubectl("get", "secrets").stdout)[0][:3] == ["tiny-keys", "Opaque", "1"]


def test_apply_from_the_crds_folder_then_apply_patch_and_delete_an_inference_deployment(
    tmp_path: Path,
) -> None:
    with start_cluster(tmp_path / "cluster", kubelet=False, crds=()) as cluster:
        missing = cluster.kubectl("get", "infd", check=False)
        assert missing.returncode != 0
        assert 'the server doesn\'t have a resource type "infd"' in missing.stderr

        out = cluster.kubectl("apply", "-f", str(ROOT / "crds")).stdout
        assert "inferencedeployments.kvfence.dev created" in out
        crds = cluster.kubectl("get", "crd").stdout
        assert crds.splitlines()[0].split() == ["NAME", "CREATED", "AT"]
        ((name, created),) = rows(crds)[1:]
        assert name == "inferencedeployments.kvfence.dev"
        assert created.endswith("Z")  # the timestamp, as kubectl shows it for CRDs
        crd = cluster.get("CustomResourceDefinition", "inferencedeployments.kvfence.dev")
        assert crd is not None
        established = [c for c in crd["status"]["conditions"] if c["type"] == "Established"]
        assert [c["status"] for c in established] == ["True"]

        manifest = tmp_path / "tiny.yaml"
        manifest.write_text(yaml.safe_dump(inference_deployment(context_length=512)))
        assert cluster.kubectl("apply", "-f", str(manifest)).stdout.strip() == (
            "inferencedeployment.kvfence.dev/tiny created"
        )
        manifest.write_text(yaml.safe_dump(inference_deployment(context_length=1024)))
        assert cluster.kubectl("apply", "-f", str(manifest)).stdout.strip() == (
            "inferencedeployment.kvfence.dev/tiny configured"
        )
        obj = cluster.get(KIND, "tiny", api_version=API_VERSION)
        assert obj is not None
        assert obj["spec"]["contextLength"] == 1024 and obj["metadata"]["generation"] == 2
        applied = obj["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
        assert '"contextLength":1024' in applied
        unchanged = cluster.kubectl("apply", "-f", str(manifest)).stdout.strip()
        assert unchanged == "inferencedeployment.kvfence.dev/tiny unchanged"

        cluster.kubectl("patch", "infd", "tiny", "--type", "merge", "-p",
                        '{"spec":{"poolPolicy":"LowerContext"}}')  # fmt: skip
        obj = cluster.get(KIND, "tiny", api_version=API_VERSION)
        assert obj is not None and obj["spec"]["poolPolicy"] == "LowerContext"
        assert obj["metadata"]["generation"] == 3

        server_side = inference_deployment("other", context_length=256)
        served = cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.dump(server_side))
        assert served.stdout.strip() == "inferencedeployment.kvfence.dev/other serverside-applied"
        server_side["spec"]["contextLength"] = 128
        cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(server_side))
        other = cluster.get(KIND, "other", api_version=API_VERSION)
        assert other is not None and other["spec"]["contextLength"] == 128

        owner = cluster.get(KIND, "tiny", api_version=API_VERSION)
        assert owner is not None
        ref = {"apiVersion": API_VERSION, "kind": KIND, "name": "tiny",
               "uid": owner["metadata"]["uid"], "controller": True}  # fmt: skip
        cluster.create({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "tiny-child", "ownerReferences": [ref]}})  # fmt: skip
        deleted = cluster.kubectl("delete", "infd", "tiny", "--timeout=30s").stdout.strip()
        assert deleted == 'inferencedeployment.kvfence.dev "tiny" deleted'
        assert cluster.get(KIND, "tiny", api_version=API_VERSION) is None
        cluster.wait_gone("ConfigMap", "tiny-child")  # cascading through ownerReferences


def test_watch_prints_rows_as_they_change_and_wait_returns_on_the_condition(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.create(inference_deployment())
    printed = tmp_path / "watch.out"
    watcher = subprocess.Popen(
        ["kubectl", "get", "infd", "-w"],
        stdout=printed.open("w"),
        stderr=subprocess.PIPE,
        text=True,
        env=cluster.kubectl_env(),
    )
    try:
        timer = threading.Timer(
            1.5,
            lambda: cluster.patch(KIND, "tiny", {"status": live_status()}, subresource="status",
                                  api_version=API_VERSION),
        )  # fmt: skip
        timer.start()
        started = time.monotonic()
        cluster.kubectl("wait", "--for=condition=Ready", "infd/tiny", "--timeout=30s")
        assert time.monotonic() - started >= 1.0  # it waited for the status, not past it
        eventually(
            printed.read_text,
            "the watch to print the Ready row",
            until=lambda out: any(
                line.split()[:3] == ["tiny", "True", "512"] for line in out.splitlines()
            ),
        )
    finally:
        watcher.terminate()
        _, err = watcher.communicate(timeout=10)
    out = printed.read_text()
    lines = out.splitlines()
    assert lines[0].split() == CRD_COLUMNS, (out, err)
    assert lines[1].split()[0] == "tiny" and len(lines[1].split()) == 2  # name and age only
    assert any(line.split()[:3] == ["tiny", "True", "512"] for line in lines[2:]), (out, err)


def test_describe_lists_the_objects_events(cluster: Cluster) -> None:
    created = cluster.create(inference_deployment())
    involved = {"apiVersion": API_VERSION, "kind": KIND, "name": "tiny", "namespace": "default",
                "uid": created["metadata"]["uid"]}  # fmt: skip
    for name, reason, message, target in (
        ("tiny.1", "RolloutStarted", "revision 8d41c2a7e0 is rolling out", involved),
        ("other.1", "Unrelated", "about something else", {**involved, "name": "other",
                                                          "uid": "another-uid"}),
    ):  # fmt: skip
        cluster.create({"apiVersion": "v1", "kind": "Event",
                        "metadata": {"name": name}, "involvedObject": target,
                        "reason": reason, "message": message, "type": "Normal",
                        "source": {"component": "kvfence-operator"}, "count": 1,
                        "firstTimestamp": created["metadata"]["creationTimestamp"],
                        "lastTimestamp": created["metadata"]["creationTimestamp"]})  # fmt: skip
    described = cluster.kubectl("describe", "infd", "tiny").stdout
    assert "Name:         tiny" in described
    events = described.split("Events:", 1)[1]
    assert "RolloutStarted" in events and "revision 8d41c2a7e0 is rolling out" in events
    assert "kvfence-operator" in events
    assert "Unrelated" not in events

    listed = cluster.kubectl("get", "events").stdout
    assert listed.splitlines()[0].split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert "inferencedeployment/tiny" in listed


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("get", "infd", "nope"),
         'Error from server (NotFound): inferencedeployments.kvfence.dev "nope" not found'),
        (("delete", "pod", "nope"), 'Error from server (NotFound): pods "nope" not found'),
        (("create", "serviceaccount", "robot"),
         "error: failed to create serviceaccount: v1 ServiceAccount in protobuf is not "
         "served (only Secret, ConfigMap, Namespace); send JSON"),
    ],
)  # fmt: skip
def test_errors_are_one_line_in_kubectls_shape(
    cluster: Cluster, args: tuple[str, ...], error: str
) -> None:
    failed = cluster.kubectl(*args, check=False)
    assert failed.returncode == 1
    assert failed.stderr.strip() == error


WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget",
                  "shortNames": ["wd"], "categories": ["all"]},
        "scope": "Namespaced",
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {"spec": {"type": "object", "description": "What a widget is.",
                                        "x-kubernetes-preserve-unknown-fields": True}},
            }},
            "additionalPrinterColumns": [
                {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                {"name": "Owner", "type": "string", "jsonPath": ".spec.owner", "priority": 1},
                {"name": "Shiny", "type": "boolean", "jsonPath": ".spec.shiny"},
                {"name": "Tags", "type": "string", "jsonPath": ".spec.tags"},
                {"name": "Since", "type": "date", "jsonPath": ".spec.since"},
            ],
        }],
    },
}  # fmt: skip


def widget(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "example.com/v1", "kind": "Widget",
            "metadata": {"name": name, "namespace": namespace, "labels": {"team": name}},
            "spec": spec}  # fmt: skip


def test_a_crd_applied_later_gets_its_columns_typed_with_priority_for_wide(
    cluster: Cluster,
) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(WIDGET_CRD))
    widgets = [
        widget(
            "b", size=3, owner="ann", shiny=True, tags=["red", "blue"], since="2020-01-01T00:00:00Z"
        ),
        widget("a", size="big", shiny="yes"),  # wrong types: empty cells, as Kubernetes shows
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(widgets))

    out = cluster.kubectl("get", "wd").stdout
    assert out.splitlines()[0].split() == ["NAME", "SIZE", "SHINY", "TAGS", "SINCE"]
    row_a, row_b = cells(out)
    assert row_a == ["a", "", "", "", ""]
    assert row_b[:4] == ["b", "3", "true", '["red","blue"]'] and row_b[4].endswith("d")
    wide = cluster.kubectl("get", "wd", "-o", "wide").stdout
    assert wide.splitlines()[0].split() == ["NAME", "SIZE", "OWNER", "SHINY", "TAGS", "SINCE"]
    assert cells(wide)[1][2] == "ann"

    labelled = cluster.kubectl("get", "wd", "--show-labels", "-L", "team").stdout
    assert [row[-2:] for row in cells(labelled)] == [["a", "team=a"], ["b", "team=b"]]
    by_name = cluster.kubectl("get", "wd", "--sort-by=.metadata.name", "--no-headers").stdout
    assert [line.split()[0] for line in by_name.splitlines()] == ["a", "b"]
    assert "widget.example.com/b" in cluster.kubectl("get", "all").stdout  # its category

    explained = cluster.kubectl("explain", "wd.spec").stdout
    assert "What a widget is." in explained
    pods = cluster.kubectl("explain", "pods", check=False)
    assert pods.returncode == 1 and "not found in OpenAPI schema" in pods.stderr

    cluster.kubectl("delete", "crd", "widgets.example.com")
    gone = cluster.kubectl("get", "widgets.example.com", check=False)
    assert gone.returncode == 1 and "widgets" in gone.stderr
    assert cluster.loop.run(_widgets_left(cluster)) == []  # its objects went with it


async def _widgets_left(cluster: Cluster) -> list[dict[str, Any]]:
    kind = ResourceType("example.com", "v1", "widgets", "Widget", namespaced=True, custom=True)
    return cluster.server.store.list_objects(kind)


def test_deleting_a_namespace_deletes_what_is_in_it(cluster: Cluster) -> None:
    cluster.kubectl("create", "namespace", "team-b")
    cluster.kubectl("create", "configmap", "settings", "-n", "team-b", "--from-literal=a=b")
    cluster.create(inference_deployment("elsewhere"), namespace="team-b")
    cluster.create(inference_deployment("kept"))
    assert cluster.kubectl("delete", "namespace", "team-b").stdout.strip() == (
        'namespace "team-b" deleted'
    )
    assert cluster.kubectl("get", "cm,infd", "-n", "team-b", "-o", "name").stdout == ""
    assert cluster.kubectl("get", "infd", "-A", "-o", "name").stdout.split() == [
        "inferencedeployment.kvfence.dev/kept"
    ]


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(1, "1s"), (70, "70s"), (190, "3m10s"), (70 * 60, "70m"), (47 * 3600, "47h"),
     (49 * 3600, "2d1h"), ((8 * 24 + 2) * 3600, "8d"), (367 * 24 * 3600, "367d"),
     ((365 * 2 * 24 + 25) * 3600, "2y1d"), ((365 * 8 * 24 + 2) * 3600, "8y"), (-5, "<invalid>")],
)  # fmt: skip
def test_ages_read_as_kubectl_shows_them(seconds: int, shown: str) -> None:
    """apimachinery's duration.HumanDuration, whose test cases these are."""
    assert human_duration(seconds) == shown


def test_a_pods_status_column_says_how_its_containers_ended(cluster: Cluster) -> None:
    def pod(name: str, code: int) -> dict[str, Any]:
        command = ["python", "-c", f"raise SystemExit({code})"]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {"restartPolicy": "Never",
                         "containers": [{"name": "main", "image": "python",
                                         "command": command}]}}  # fmt: skip

    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([pod("ok", 0), pod("bad", 3)]))
    cluster.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "pod/ok", "--timeout=30s")
    cluster.kubectl("wait", "--for=jsonpath={.status.phase}=Failed", "pod/bad", "--timeout=30s")
    shown = {row[0]: row[1:4] for row in cells(cluster.kubectl("get", "pods").stdout)}
    assert shown == {"ok": ["0/1", "Completed", "0"], "bad": ["0/1", "Error", "0"]}
