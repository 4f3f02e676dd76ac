"""The InferenceDeployment `tiny` that the operator's end-to-end tests deploy on a test cluster
(builtin:tiny-random, one pod per role), and what they read and wait for about it: its
conditions, its revisions' pods, what its routers route to, the canary's tries.

Tests on hollow pods (`@pytest.mark.hollow`) read the same facts; a completion through a
router (`complete`) needs real engines."""

import base64
import json
from collections.abc import Callable
from typing import Any

import openai

from kvfence_devcluster.fixtures import Cluster
from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.tools import http_clients
from kvfence_operator.builders.secret import INTERNAL_TOKEN_KEY, secret_name
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import KV_POOL_GATE, LABEL_REVISION, LABEL_ROLE, Instance, selector
from kvfence_operator.revision import revision_of

from .waits import READY_S

NAME = "tiny"
USER_KEY = "sk-user-a-0123456789"
KIND = ("InferenceDeployment", "kvfence.dev/v1alpha1")
# tiny-random KV costs 768 bytes per token: 96 pages of 16 tokens hold 1536 tokens.
ENOUGH = str(96 * 16 * 768)

Amend = Callable[[dict[str, Any], list[str]], list[str]]


def manifest(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "engine": {"kvCacheMemory": ENOUGH, "extraArgs": ["--threads", "1"]},
            "contextLength": 1024,
            "prefill": {"resources": {"requests": {"cpu": "1"}}},
            "decode": {"resources": {"requests": {"cpu": "1"}}},
            "router": {"apiKeysSecret": f"{NAME}-keys"},
            "canary": {"timeoutSeconds": 120},
            **spec,
        },
    }


def with_max_num_seqs(seqs: str, **spec: Any) -> dict[str, Any]:
    """The manifest with --max-num-seqs in the engines' extraArgs: a new revision."""
    engine = {"kvCacheMemory": ENOUGH, "extraArgs": ["--threads", "1", "--max-num-seqs", seqs]}
    return manifest(engine=engine, **spec)


def revision_of_manifest(obj: dict[str, Any]) -> str:
    return revision_of(InferenceDeploymentSpec.model_validate(obj["spec"]))


def api_keys_secret() -> dict[str, Any]:
    keys = base64.b64encode(f"{USER_KEY} team-a\n".encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{NAME}-keys"},
        "data": {"api-keys": keys},
    }


def update_spec(cluster: Cluster, spec: dict[str, Any]) -> dict[str, Any]:
    return cluster.patch(*KIND[:1], NAME, {"spec": spec}, api_version=KIND[1])


def infd(cluster: Cluster) -> dict[str, Any]:
    obj = cluster.get(*KIND[:1], NAME, api_version=KIND[1])
    assert obj is not None
    return obj


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind]
    return found[0] if found else {}


def events(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    return [e for e in cluster.list("Event", "default") if e.get("reason") == reason]


def wait_events(cluster: Cluster, reason: str, naming: str = "") -> list[dict[str, Any]]:
    """The `reason` Events whose message names `naming`, once there is one: kopf posts a
    pass's Events beside its status patch, not before it, so a status can be read first."""
    return cluster.wait_for(
        lambda: [e for e in events(cluster, reason) if naming in e["message"]],
        f"a {reason} Event" + (f" naming {naming}" if naming else ""),
    )


def wait_condition(
    cluster: Cluster, kind: str, status: str, timeout: float = READY_S, reason: str | None = None
) -> dict[str, Any]:
    def holds(obj: dict[str, Any]) -> bool:
        c = condition(obj, kind)
        return c.get("status") == status and (reason is None or c.get("reason") == reason)

    return cluster.wait_for(
        lambda: infd(cluster), f"{kind}={status} ({reason or 'any reason'})", timeout, until=holds
    )


def selector_for(revision: str, role: Role) -> dict[str, str]:
    return selector(Instance(NAME, "default", "uid-unused-in-selectors"), revision, role)


def engine_pods(cluster: Cluster, revision: str) -> list[dict[str, Any]]:
    instance_labels = {"app.kubernetes.io/instance": NAME, LABEL_REVISION: revision}
    return [
        p
        for p in cluster.list("Pod", "default", instance_labels)
        if p["metadata"]["labels"].get(LABEL_ROLE) in ("prefill", "decode")
    ]


def router_pod(cluster: Cluster, revision: str) -> dict[str, Any]:
    (pod,) = cluster.list("Pod", "default", selector_for(revision, Role.ROUTER))
    return pod


def router_client(cluster: Cluster, revision: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=cluster.pod_url(router_pod(cluster, revision)) + "/v1",
        api_key=USER_KEY,
        max_retries=0,
        timeout=60,
    )


def complete(cluster: Cluster, revision: str, prompt: str = "hello", tokens: int = 2) -> int:
    """A user's completion through the revision's router (real engines only): its tokens."""
    answer = router_client(cluster, revision).completions.create(
        model="tiny-random", prompt=prompt, max_tokens=tokens, temperature=0
    )
    assert answer.usage is not None
    return answer.usage.completion_tokens


def internal_token(cluster: Cluster, revision: str) -> str:
    """The revision's internal token, from the Secret the operator created for it."""
    instance = Instance(NAME, "default", infd(cluster)["metadata"]["uid"])
    secret = cluster.get("Secret", secret_name(instance, revision))
    assert secret is not None
    return base64.b64decode(secret["data"][INTERNAL_TOKEN_KEY]).decode()


def routed_to(cluster: Cluster, revision: str) -> dict[str, list[str]]:
    """What the revision's router routes to now, per role (GET /internal/v1/backends, which
    real and hollow routers answer): what the operator wrote and pushed to it."""
    answer = http_clients.get(
        cluster.pod_url(router_pod(cluster, revision)) + "/internal/v1/backends",
        headers={TOKEN_HEADER: internal_token(cluster, revision)},
        timeout=5,
    )
    assert answer.status_code == 200, answer.text
    backends = answer.json()["backends"]
    return {role: sorted(backends[role]) for role in ("prefill", "decode")}


def engine_urls(cluster: Cluster, revision: str) -> dict[str, list[str]]:
    """The revision's engine pods that may serve, per role, as URLs."""
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for pod in engine_pods(cluster, revision):
        if (pod.get("status") or {}).get("phase") == "Running" and not pod["metadata"].get(
            "deletionTimestamp"
        ):
            urls[pod["metadata"]["labels"][LABEL_ROLE]].append(cluster.pod_url(pod))
    return {role: sorted(found) for role, found in urls.items()}


def backends_of(cluster: Cluster, revision: str) -> dict[str, Any]:
    """The revision's router ConfigMap's backends.json."""
    configmap = cluster.get("ConfigMap", f"{NAME}-{revision}-router")
    assert configmap is not None
    return dict(json.loads(configmap["data"]["backends.json"]))


def gates(cluster: Cluster, revision: str) -> list[str | None]:
    """The kv-pool gate's status on each of the revision's engine pods."""
    return [
        (cluster.pod_condition(p, KV_POOL_GATE) or {}).get("status")
        for p in engine_pods(cluster, revision)
    ]


def canary_tries(cluster: Cluster, revision: str) -> list[dict[str, Any]]:
    """The terminated states of the revision's canary pods."""
    pods = cluster.list("Pod", "default", selector_for(revision, Role.CANARY))
    return [(p["status"]["containerStatuses"][0]["state"].get("terminated") or {}) for p in pods]


def early_release_in_decode_of(revision: str) -> Amend:
    """A kubelet `amend_argv`: that revision's decode pods run with --unsafe-fault
    early-release (which no InferenceDeployment can ask for), so its canary must fail."""

    def amend(pod: dict[str, Any], argv: list[str]) -> list[str]:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(LABEL_REVISION) == revision and labels.get(LABEL_ROLE) == "decode":
            return [*argv, "--unsafe-fault", "early-release"]
        return argv

    return amend


def hollow_canary_flags(revision: str, flags: Callable[[], list[str]]) -> Amend:
    """A kubelet `amend_argv` for hollow pods: that revision's canary pods run with the
    hollow-only flags `flags()` (`--hollow-verdict fail|cannot-run`, `--hollow-wait-for FILE`:
    hollow.py), asked as each canary pod starts."""

    def amend(pod: dict[str, Any], argv: list[str]) -> list[str]:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(LABEL_REVISION) == revision and labels.get(LABEL_ROLE) == "canary":
            return [*argv, *flags()]
        return argv

    return amend


def check_first_rollout(
    cluster: Cluster, created: dict[str, Any], revision: str, min_pool_tokens: int = 1536
) -> None:
    """Children owned by the InferenceDeployment, gates open, canary passed, stable Service on
    the revision, status complete, and the router routing to the revision's engines."""
    ready = wait_condition(cluster, "Ready", "True", timeout=READY_S)
    status = ready["status"]

    assert status["revision"]["current"] == revision
    assert status["revision"].get("candidate") is None
    assert status["canary"]["result"] == "Passed"
    assert status["contextLength"] == {"requested": 1024, "effective": 1024}
    assert status["minPoolTokens"] == min_pool_tokens
    assert {p["role"] for p in status["pools"]} == {"prefill", "decode"}
    assert status["observedGeneration"] == created["metadata"]["generation"]
    for kind in ("Ready", "PoolSufficient", "CanaryPassed"):
        assert condition(ready, kind)["status"] == "True", kind
    assert condition(ready, "Degraded")["status"] == "False"
    assert condition(ready, "Progressing")["status"] == "False"

    uid = created["metadata"]["uid"]
    for kind in ("Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy", "Job"):
        children = cluster.list(kind, "default", {"app.kubernetes.io/instance": NAME})
        assert children, kind
        for child in children:
            owners = child["metadata"].get("ownerReferences") or []
            assert [o["uid"] for o in owners] == [uid], f"{kind} {child['metadata']['name']}"

    assert gates(cluster, revision) == ["True", "True"]
    (job,) = cluster.list("Job", "default", selector_for(revision, Role.CANARY))
    assert job["status"].get("succeeded") == 1

    stable = cluster.get("Service", NAME)
    assert stable is not None
    assert stable["spec"]["selector"][LABEL_REVISION] == revision
    cluster.wait_for(
        lambda: routed_to(cluster, revision),
        "the router to route to the revision's engines",
        until=lambda routed: routed == engine_urls(cluster, revision),
    )


def wait_promoted(cluster: Cluster, revision: str, what: str) -> dict[str, Any]:
    """Wait until `revision` serves and is Ready: its canary passed, the stable Service
    selects it."""
    promoted = cluster.wait_for(
        lambda: infd(cluster),
        what,
        timeout=READY_S,
        until=lambda o: (
            o["status"]["revision"].get("current") == revision
            and condition(o, "Ready").get("status") == "True"
        ),
    )
    assert promoted["status"]["canary"]["revision"] == revision
    assert cluster.require("Service", NAME)["spec"]["selector"][LABEL_REVISION] == revision
    return promoted


def container_args(cluster: Cluster, revision: str, role: str) -> list[str]:
    """The command line of the one pod of `revision` in `role`."""
    labels = {"app.kubernetes.io/instance": NAME, LABEL_REVISION: revision, LABEL_ROLE: role}
    (pod,) = cluster.list("Pod", "default", labels)
    (container,) = pod["spec"]["containers"]
    return [*container.get("command", []), *container.get("args", [])]
