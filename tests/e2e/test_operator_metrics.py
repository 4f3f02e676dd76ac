"""The operator with the chart's settings on the emulated cluster. Prometheus's view: it keeps
the metrics token Secret it finds in its namespace, and every engine and router pod it starts
answers /metrics, and nothing else, to that token; the NetworkPolicies admit the scrapers to
the HTTP port. Derived credentials: it makes the credentials key Secret in its namespace, the
revision's Secret holds what that key derives, and the revision serves (its pools were read
with the derived token)."""

import base64
import json
from functools import partial
from typing import Any

import httpx

from helpers.tiny_infd import NAME, api_keys_secret, manifest, wait_condition
from helpers.waits import READY_S
from kvfence_devcluster.fixtures import Cluster
from kvfence_operator.builders.secret import INTERNAL_TOKEN_KEY, RevisionCredentials, secret_name
from kvfence_operator.cluster.metrics_token import SCRAPERS_ENV, TOKEN_SECRET_ENV
from kvfence_operator.cluster.own_secrets import CREDENTIALS_KEY_SECRET_ENV
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import LABEL_REVISION, Instance, child_name
from kvfence_operator.revision import revision_of

OPERATOR_NS, SECRET = "kvfence-system", "kvfence-metrics-token"
TOKEN = "chosen-by-the-platform-team-0123456789"
SCRAPERS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def scrape(url: str, path: str = "/metrics") -> int:
    try:
        return httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code
    except httpx.HTTPError:
        return 0  # not listening yet


def test_engine_and_router_pods_answer_metrics_to_the_token_in_the_operators_secret(
    cluster: Cluster,
) -> None:
    cluster.create(api_keys_secret())
    token_data = {"token": base64.b64encode(TOKEN.encode()).decode()}
    cluster.create(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "data": token_data},
        namespace=OPERATOR_NS,
    )
    env = {
        "KVFENCE_RECONCILE_INTERVAL": "1",
        "OPERATOR_NAMESPACE": OPERATOR_NS,
        TOKEN_SECRET_ENV: SECRET,
        SCRAPERS_ENV: json.dumps(SCRAPERS),
        CREDENTIALS_KEY_SECRET_ENV: "kvfence-credentials-key",
    }
    operator = cluster.start_operator(["--standalone", "--namespace", "default"], env=env)
    created = cluster.create(manifest(canary={"enabled": False}))
    revision = revision_of(InferenceDeploymentSpec.model_validate(created["spec"]))
    instance = Instance(NAME, "default", created["metadata"]["uid"])

    def pods() -> dict[str, Any]:
        labels = {"app.kubernetes.io/instance": NAME, LABEL_REVISION: revision}
        return {
            p["metadata"]["labels"]["kvfence.dev/role"]: p
            for p in cluster.list("Pod", "default", labels)
            if p.get("status", {}).get("podIP")
        }

    found = cluster.wait_for(pods, "engine and router pods", 120, until=lambda p: len(p) == 3)
    for role, pod in found.items():
        url = cluster.pod_url(pod)
        internal = "/internal/v1/backends" if role == "router" else "/internal/v1/tokenizer"
        cluster.wait_for(partial(scrape, url), f"{role}'s /metrics", 240, until=lambda s: s == 200)
        assert scrape(url, "/v1/kvpool") == 401, role
        assert scrape(url, internal) == 401, role
    kept = cluster.get("Secret", SECRET, OPERATOR_NS)
    assert kept is not None and kept["data"] == token_data, "an existing token is never replaced"
    for role in (Role.PREFILL, Role.DECODE, Role.ROUTER):
        policy = cluster.get("NetworkPolicy", child_name(instance, revision, role))
        assert policy is not None
        assert {"from": SCRAPERS, "ports": [{"protocol": "TCP", "port": 8000}]} in policy["spec"][
            "ingress"
        ], role
    wait_condition(cluster, "Ready", "True", timeout=READY_S)
    key_secret = cluster.get("Secret", "kvfence-credentials-key", OPERATOR_NS)
    assert key_secret is not None, "made at start-up"
    key = base64.b64decode(key_secret["data"]["key"])
    revision_secret = cluster.get("Secret", secret_name(instance, revision))
    assert revision_secret is not None
    derived = RevisionCredentials.derive(key, instance, revision).internal_token
    assert base64.b64decode(revision_secret["data"][INTERNAL_TOKEN_KEY]).decode() == derived
    operator.stop()
