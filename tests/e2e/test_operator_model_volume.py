"""A model on a PersistentVolumeClaim (issue 15, item 4): only the engine pods mount it (a
ReadWriteOnce claim attaches to one node, so a router pod on another would never start); the
router reads the tokenizer from its engines, serves, and still refuses an over-long prompt. On
the test cluster, with the claim mapped to a local folder holding SmolLM2's GGUF."""

import base64
from pathlib import Path
from typing import Any

import openai
import pytest

from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_engine.loading.tokenizer_source import smollm2_gguf_path
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.meta import LABEL_REVISION
from kvfence_operator.revision import revision_of

NAME = "onclaim"
USER_KEY = "sk-user-claim-0123456789"
CONTEXT = 256


def manifest() -> dict[str, Any]:
    return {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "model": {
                "name": "smollm",
                "source": f"/models/{smollm2_gguf_path().name}",
                "volume": {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
            },
            "engine": {"kvCacheMemory": "16Mi", "extraArgs": ["--threads", "1"]},
            "contextLength": CONTEXT,
            "prefill": {"resources": {"requests": {"cpu": "1"}}},
            "decode": {"resources": {"requests": {"cpu": "1"}}},
            "router": {"apiKeysSecret": f"{NAME}-keys"},
            "canary": {"enabled": False},
        },
    }


def pods(cluster: Cluster, revision: str, role: str) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/instance": NAME, LABEL_REVISION: revision}
    return [
        p
        for p in cluster.list("Pod", "default", labels | {"kvfence.dev/role": role})
        if not p["metadata"].get("deletionTimestamp")
    ]


def test_a_router_without_the_model_volume_serves_and_refuses_over_long_prompts(
    tmp_path: Path,
) -> None:
    claim = tmp_path / "claim"
    claim.mkdir()
    (claim / smollm2_gguf_path().name).symlink_to(smollm2_gguf_path())
    options = KubeletOptions(claims={"weights": claim})
    with start_cluster(tmp_path / "cluster", kubelet=options) as cluster:
        keys = base64.b64encode(f"{USER_KEY} team-a\n".encode()).decode()
        cluster.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": f"{NAME}-keys"},
                "data": {"api-keys": keys},
            }
        )
        operator = cluster.start_operator(
            ["--standalone", "--namespace", "default"], env={"KVFENCE_RECONCILE_INTERVAL": "1"}
        )
        created = cluster.create(manifest())
        revision = revision_of(InferenceDeploymentSpec.model_validate(created["spec"]))
        (router,) = cluster.wait_for(
            lambda: pods(cluster, revision, "router"),
            "the router pod, started",
            60,
            until=lambda found: found and found[0].get("status", {}).get("podIP"),
        )
        # the router pod as the operator made it: no claim to attach
        assert [v for v in router["spec"]["volumes"] if "persistentVolumeClaim" in v] == []
        (engine,) = cluster.wait_for(
            lambda: pods(cluster, revision, "decode"), "the decode pod", 60, until=bool
        )
        assert any("persistentVolumeClaim" in v for v in engine["spec"]["volumes"])

        client = openai.OpenAI(
            base_url=cluster.pod_url(router) + "/v1", api_key=USER_KEY, max_retries=0, timeout=60
        )
        models = cluster.wait_for(
            lambda: [m.id for m in client.models.list()],  # 503 until it has the tokenizer
            "the router to serve",
            300,
            until=bool,
            interval=1.0,
        )
        assert models == ["smollm"]
        # the router serves the model list with its tokenizer alone; answers need a gated
        # decode pod in its backends, which Ready=True says
        cluster.wait_for(
            lambda: cluster.get("InferenceDeployment", NAME, api_version="kvfence.dev/v1alpha1"),
            "Ready=True",
            300,
            until=lambda obj: any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in ((obj or {}).get("status") or {}).get("conditions") or []
            ),
        )
        answer = client.chat.completions.create(
            model="smollm", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="smollm", prompt="word " * CONTEXT, max_tokens=1)
        assert refused.value.code == "context_length_exceeded"
        operator.stop()
