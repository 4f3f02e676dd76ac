"""The CRD's guard rails through the real `kubectl` (1.32, on PATH) against the devcluster,
whose API server checks custom resources against their CRD's schema and CEL rules as a
kube-apiserver does: `kubectl get kvfence` lists InferenceDeployments (the CRD's category), and
a mistyped toleration, a hostPath model volume or an extraArg that would flip a spec flag is
refused by `kubectl apply` with one line naming the field, before any Deployment exists."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfence_devcluster.fixtures import start_cluster

KIND = "InferenceDeployment"
API_VERSION = "kvfence.dev/v1alpha1"


def inference_deployment(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "contextLength": 512,
            "router": {"apiKeysSecret": f"{name}-keys"},
            **spec,
        },
    }


@pytest.fixture
def cluster(tmp_path: Path):
    # no kubelet: nothing here runs pods, only the API server answers
    with start_cluster(tmp_path / "cluster", kubelet=False) as running:
        yield running


def test_kubectl_get_kvfence_lists_inference_deployments(cluster) -> None:
    applied = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(inference_deployment("a")))
    assert applied.stdout.strip() == "inferencedeployment.kvfence.dev/a created"
    listed = cluster.kubectl("get", "kvfence", "-o", "name").stdout.split()
    assert listed == ["inferencedeployment.kvfence.dev/a"]
    resources = cluster.kubectl("api-resources", "--categories", "kvfence", "-o", "name")
    assert resources.stdout.split() == ["inferencedeployments.kvfence.dev"]


MISTAKES = [
    (
        "toleration effect",
        {"prefill": {"pod": {"tolerations": [{"key": "gpu", "effect": "NoSchedul"}]}}},
        'The InferenceDeployment "bad" is invalid: spec.prefill.pod.tolerations[0].effect: '
        'Unsupported value: "NoSchedul": supported values: "NoSchedule", "PreferNoSchedule", '
        '"NoExecute"',
    ),
    (
        "toleration field",
        {"decode": {"pod": {"tolerations": [{"key": "gpu", "tolerationSecond": 5}]}}},
        'Error from server (BadRequest): error when creating "STDIN": InferenceDeployment in '
        'version "v1alpha1" cannot be handled as a InferenceDeployment: strict decoding error: '
        'unknown field "spec.decode.pod.tolerations[0].tolerationSecond"',
    ),
    (
        "hostPath model volume",
        {"model": {"source": "/models/m.gguf", "volume": {"hostPath": {"path": "/"}}}},
        'Error from server (BadRequest): error when creating "STDIN": InferenceDeployment in '
        'version "v1alpha1" cannot be handled as a InferenceDeployment: strict decoding error: '
        'unknown field "spec.model.volume.hostPath"',
    ),
    (
        "extraArg flipping a spec flag",
        {"engine": {"kvChecksum": True, "extraArgs": ["--no-kv-checksum"]}},
        'The InferenceDeployment "bad" is invalid: spec.engine.extraArgs: Invalid value: '
        '"object": extraArgs must not set --kv-checksum or --no-kv-checksum: set '
        "engine.kvChecksum instead",
    ),
]


@pytest.mark.parametrize(("spec", "error"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_kubectl_apply_refuses_a_mistake_in_one_line(cluster, spec, error) -> None:
    refused = cluster.kubectl(
        "apply", "-f", "-", input=yaml.safe_dump(inference_deployment("bad", **spec)), check=False
    )
    assert refused.returncode == 1
    assert refused.stderr.strip() == error
    assert cluster.get(KIND, "bad", api_version=API_VERSION) is None


def test_a_mistake_in_a_patch_is_refused_and_the_object_kept(cluster) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(inference_deployment("a")))
    patch = '{"spec":{"prefill":{"pod":{"tolerations":[{"operator":"Exist"}]}}}}'
    refused = cluster.kubectl("patch", "infd", "a", "--type", "merge", "-p", patch, check=False)
    assert refused.returncode == 1
    assert 'spec.prefill.pod.tolerations[0].operator: Unsupported value: "Exist"' in refused.stderr
    kept = cluster.get(KIND, "a", api_version=API_VERSION)
    assert kept is not None and "prefill" not in kept["spec"]
