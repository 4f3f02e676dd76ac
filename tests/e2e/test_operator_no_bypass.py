"""The canary gate cannot be bypassed (issue #14 item 3), end to end: `kvfence operator` (kopf)
against the test cluster, and the real `kubectl` doing what a user with edit rights might. What
the operator writes (fences, children put back) is tested on hollow pods
(kvfence_devcluster/hollow.py); a keys change reaching a running router, on a real router."""

import base64
import json
from typing import Any

import openai
import pytest

from helpers.tiny_infd import (
    NAME,
    USER_KEY,
    engine_urls,
    manifest,
    routed_to,
    wait_condition,
)
from kvfence_devcluster.fixtures import Cluster
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.meta import LABEL_REVISION, LABEL_ROLE, OPERATOR_POD_LABELS
from kvfence_operator.revision import revision_of

NEW_KEY = "sk-user-b-9876543210"
HTTP_RULE_PORTS = [{"protocol": "TCP", "port": 8000}]


def keys_data(*lines: str) -> dict[str, str]:
    return {"api-keys": base64.b64encode("".join(f"{line}\n" for line in lines).encode()).decode()}


def create(cluster: Cluster, **spec: Any) -> str:
    created = cluster.create(manifest(**spec))
    return revision_of(InferenceDeploymentSpec.model_validate(created["spec"]))


def wait_ready(cluster: Cluster, timeout: float = 240) -> dict[str, Any]:
    return wait_condition(cluster, "Ready", "True", timeout)


def pods(cluster: Cluster, revision: str, role: str) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/instance": NAME, LABEL_REVISION: revision, LABEL_ROLE: role}
    return cluster.list("Pod", "default", labels)


def image_of(pod_spec: dict[str, Any]) -> str:
    (container,) = pod_spec["containers"]
    return str(container["image"])


def template_image(cluster: Cluster, deployment: str) -> str:
    return image_of(cluster.require("Deployment", deployment)["spec"]["template"]["spec"])


@pytest.mark.hollow
@pytest.mark.usefixtures("operator")
def test_candidate_routers_admit_only_the_canary_and_the_operator_until_promotion(cluster):
    revision = create(cluster)
    router = f"{NAME}-{revision}-router"

    # Before promotion (no stable Service yet): the routers admit only the canary and the
    # operator. The stable Service is read after the policy, so it was absent then too.
    fenced = cluster.wait_for(
        lambda: cluster.get("NetworkPolicy", router),
        "the candidate's router NetworkPolicy",
        timeout=120,
    )
    assert cluster.get("Service", NAME) is None, "promoted before the policy was seen"
    assert fenced["spec"]["podSelector"]["matchLabels"][LABEL_ROLE] == "router"
    (rule,) = fenced["spec"]["ingress"]
    assert rule["ports"] == HTTP_RULE_PORTS
    canary, operator_peer = rule["from"]
    assert canary == {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "kvfence",
                "app.kubernetes.io/instance": NAME,
                LABEL_REVISION: revision,
                LABEL_ROLE: "canary",
            }
        }
    }
    assert operator_peer["podSelector"] == {"matchLabels": OPERATOR_POD_LABELS}
    assert set(operator_peer["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"}

    # Promoted: the stable Service selects the revision, whose routers now admit everyone.
    wait_ready(cluster)
    assert cluster.get("Service", NAME)["spec"]["selector"][LABEL_REVISION] == revision
    opened = cluster.wait_for(
        lambda: cluster.get("NetworkPolicy", router)["spec"]["ingress"],
        "the router NetworkPolicy to open on promotion",
        until=lambda ingress: ingress == [{"ports": HTTP_RULE_PORTS}],
    )
    assert opened == [{"ports": HTTP_RULE_PORTS}]
    assert not cluster.problems()


@pytest.mark.hollow
@pytest.mark.usefixtures("operator")
def test_children_edited_with_kubectl_come_back_as_declared(cluster):
    revision = create(cluster, canary={"enabled": False})
    router = f"{NAME}-{revision}-router"
    wait_ready(cluster)

    # `kubectl set image` on a child Deployment: reverted, and no pod of that image remains.
    prefill = f"{NAME}-{revision}-prefill"
    declared = template_image(cluster, prefill)
    out = cluster.kubectl("set", "image", f"deployment/{prefill}", "engine=evil/engine:1").stdout
    assert "image updated" in out, out
    cluster.wait_for(
        lambda: template_image(cluster, prefill),
        "the operator to put the declared image back",
        timeout=60,
        until=lambda image: image == declared,
    )
    cluster.wait_for(
        lambda: [image_of(p["spec"]) for p in pods(cluster, revision, "prefill")],
        "only pods of the declared image",
        timeout=120,
        until=lambda images: images == [declared],
    )

    # An edited NetworkPolicy (the engines' fence opened to everyone; a label added to the
    # router policy's selector so that it selects nothing): reverted.
    engine_policy = f"{NAME}-{revision}-decode"
    before = cluster.get("NetworkPolicy", engine_policy)["spec"]
    cluster.kubectl(
        "patch", "networkpolicy", engine_policy, "--type", "merge",
        "-p", json.dumps({"spec": {"ingress": [{}]}}),
    )  # fmt: skip
    cluster.kubectl(
        "patch", "networkpolicy", router, "--type", "merge",
        "-p", json.dumps({"spec": {"podSelector": {"matchLabels": {"nothing": "selected"}}}}),
    )  # fmt: skip
    cluster.wait_for(
        lambda: cluster.get("NetworkPolicy", engine_policy)["spec"],
        "the engines' NetworkPolicy to be put back",
        timeout=60,
        until=lambda spec: spec == before,
    )
    cluster.wait_for(
        lambda: cluster.get("NetworkPolicy", router)["spec"]["podSelector"]["matchLabels"],
        "the router NetworkPolicy's selector to be put back",
        timeout=60,
        until=lambda labels: "nothing" not in labels and labels[LABEL_ROLE] == "router",
    )

    # A revision Service pointed elsewhere: put back.
    cluster.kubectl(
        "patch", "service", router, "--type", "merge",
        "-p", json.dumps({"spec": {"selector": {LABEL_ROLE: "decode"}}}),
    )  # fmt: skip
    cluster.wait_for(
        lambda: cluster.get("Service", router)["spec"]["selector"][LABEL_ROLE],
        "the router Service's selector to be put back",
        timeout=60,
        until=lambda role: role == "router",
    )

    # and the revision serves again through the reverted children: its router routes to the
    # engine pods of the declared image (a failed read is an observation: pods were replaced)
    wait_ready(cluster)
    cluster.wait_for(
        lambda: routed_to(cluster, revision),
        "the router to route to the revision's pods after the reverts",
        timeout=120,
        until=lambda routed: routed == engine_urls(cluster, revision) and all(routed.values()),
    )
    assert not cluster.problems()


@pytest.mark.usefixtures("operator")
def test_a_keys_secret_change_reaches_the_running_router_without_a_restart(cluster):
    revision = create(cluster, canary={"enabled": False})
    wait_ready(cluster)
    (router_pod,) = pods(cluster, revision, "router")
    url = cluster.pod_url(router_pod) + "/v1"

    def completes(key: str) -> bool:
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        try:
            client.completions.create(model="tiny-random", prompt="hi", max_tokens=1)
        except openai.AuthenticationError:
            return False
        return True

    assert completes(USER_KEY) is True
    assert completes(NEW_KEY) is False

    # revoke the user's key, add another: the running router follows within seconds
    cluster.patch("Secret", f"{NAME}-keys", {"data": keys_data(f"{NEW_KEY} team-b")})
    cluster.wait_for(
        lambda: completes(USER_KEY), "the revoked key to get 401", 20, lambda ok: not ok
    )
    assert completes(NEW_KEY) is True

    (same,) = pods(cluster, revision, "router")
    assert same["metadata"]["uid"] == router_pod["metadata"]["uid"], "the router was replaced"
    restarts = [s.get("restartCount", 0) for s in same["status"].get("containerStatuses") or []]
    assert restarts == [0]
    assert not cluster.problems()
