"""The router, the stable Service, the canary Job, the revision Secret and the NetworkPolicies."""

import base64
import json

import pytest

from helpers.builders import (
    CREDENTIALS,
    OPERATOR_NAMESPACE,
    container,
    flag,
    instance_for,
    pod_spec,
    sample_spec,
)
from kvfence_operator.builders.canary_job import build_canary_job
from kvfence_operator.builders.network_policy import build_network_policies
from kvfence_operator.builders.router_deployment import (
    build_router_configmap,
    build_router_deployment,
    build_router_service,
    build_stable_service,
    router_args,
)
from kvfence_operator.builders.secret import RevisionCredentials, build_revision_secret

REVISION = "abcdef0123"


def test_router_runs_with_backends_file_both_key_files_context_and_token():
    deployment = build_router_deployment(sample_spec("full"), instance_for("full"), REVISION)
    c = container(deployment)
    args = c["args"]
    assert c["command"] == ["kvfence"] and args[0] == "router"
    assert flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--port") == "8000"
    assert flag(args, "--backends-file") == "/etc/kvfence/backends.json"
    assert "--tokenizer-from-engines" in args  # a model on a volume: no --model, no mount
    assert "--context-length" not in args  # the backends file carries the served context
    assert flag(args, "--internal-token-file") == "/var/run/kvfence/internal-token"
    key_files = [args[i + 1] for i, a in enumerate(args) if a == "--api-keys"]
    assert key_files == ["/var/run/kvfence/api-keys/tenants", "/var/run/kvfence/api-keys/canary"]
    assert deployment["spec"]["replicas"] == 2
    assert "readinessGates" not in pod_spec(deployment)
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])


def test_the_tenant_concurrency_limit_becomes_the_routers_flag():
    spec = sample_spec("minimal")
    assert "--max-concurrent-per-tenant" not in router_args(spec)
    spec.tenant_limits.max_concurrent_requests = 8
    assert flag(router_args(spec), "--max-concurrent-per-tenant") == "8"


def test_router_credentials_combine_the_users_keys_with_the_revisions_token_and_canary_keys():
    deployment = build_router_deployment(sample_spec("full"), instance_for("full"), REVISION)
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == "credentials"]
    sources = {s["secret"]["name"]: s["secret"]["items"] for s in volume["projected"]["sources"]}
    assert sources == {
        f"full-{REVISION}-credentials": [
            {"key": "internal-token", "path": "internal-token"},
            {"key": "canary-api-keys", "path": "api-keys/canary"},
        ],
        "full-api-keys": [{"key": "api-keys", "path": "api-keys/tenants"}],
    }


def test_backends_file_lists_the_pool_checked_pods_and_the_served_context():
    spec, instance = sample_spec("full"), instance_for("full")
    configmap = build_router_configmap(
        spec,
        instance,
        REVISION,
        context_length=6144,
        prefill_urls=["http://10.0.0.2:8000"],
        decode_urls=["http://10.0.0.4:8000", "http://10.0.0.3:8000"],
        version=7,
    )
    backends = json.loads(configmap["data"]["backends.json"])
    assert backends == {
        "version": 7,
        "revision": REVISION,
        "model": {"source": "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "name": "smollm2-135m"},
        "contextLength": 6144,
        "prefill": ["http://10.0.0.2:8000"],
        "decode": ["http://10.0.0.3:8000", "http://10.0.0.4:8000"],
    }
    default = json.loads(build_router_configmap(spec, instance, REVISION)["data"]["backends.json"])
    assert default["contextLength"] == 8192
    assert default["prefill"] == default["decode"] == []  # no pod has passed its pool check


def test_stable_service_points_at_the_given_revisions_routers():
    service = build_stable_service(sample_spec("full"), instance_for("full"), REVISION)
    assert service["metadata"]["name"] == "full"
    assert service["metadata"]["annotations"] == {
        "service.beta.kubernetes.io/aws-load-balancer-internal": "true",
        # which keys are the spec's, so that one dropped from it can be removed
        "kvfence.dev/managed-annotations": "service.beta.kubernetes.io/aws-load-balancer-internal",
    }
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["selector"] == {
        "app.kubernetes.io/name": "kvfence",
        "app.kubernetes.io/instance": "full",
        "kvfence.dev/revision": REVISION,
        "kvfence.dev/role": "router",
    }
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 443, "targetPort": "http", "protocol": "TCP"}
    ]


def test_each_revision_has_its_own_router_service_for_the_canary():
    service = build_router_service(instance_for("minimal"), REVISION)
    assert service["metadata"]["name"] == f"smollm-{REVISION}-router"
    assert service["spec"]["selector"]["kvfence.dev/revision"] == REVISION


def test_canary_job_attacks_the_candidate_router_once_with_keys_from_the_secret():
    job = build_canary_job(
        sample_spec("cpu-lower-context"), instance_for("cpu-lower-context"), REVISION, 3072
    )
    c = container(job)
    args = c["args"]
    assert args[0] == "canary"
    assert flag(args, "--target") == f"http://cpu-demo-{REVISION}-router.default.svc:8000"
    assert flag(args, "--context-length") == "3072"
    assert flag(args, "--termination-log") == "/dev/termination-log"
    assert "--report" not in args  # the human summary goes to the pod log
    assert flag(args, "--timeout") == "300"
    assert "--tenant-a-key=$(KVFENCE_CANARY_TENANT_A_KEY)" in args
    assert "--tenant-b-key=$(KVFENCE_CANARY_TENANT_B_KEY)" in args
    env = {e["name"]: e.get("valueFrom") for e in c["env"]}
    secret = f"cpu-demo-{REVISION}-credentials"
    assert env["KVFENCE_CANARY_TENANT_A_KEY"] == {
        "secretKeyRef": {"name": secret, "key": "canary-tenant-a-key"}
    }
    assert env["KVFENCE_CANARY_TENANT_B_KEY"] == {
        "secretKeyRef": {"name": secret, "key": "canary-tenant-b-key"}
    }
    # exit 1 (a finding) fails the Job at once; a canary that could not run is retried
    assert job["spec"]["backoffLimit"] == 3
    assert job["spec"]["podFailurePolicy"]["rules"][0]["action"] == "FailJob"
    assert job["spec"]["activeDeadlineSeconds"] > 300
    assert pod_spec(job)["restartPolicy"] == "Never"
    assert c["image"] == "ghcr.io/kvfence/kvfence-engine:0.1.0"


def test_canary_image_defaults_to_the_engine_image_and_can_be_set():
    full = container(build_canary_job(sample_spec("full"), instance_for("full"), REVISION))
    assert full["image"] == "registry.example/kvfence/engine:0.1.0"
    assert flag(full["args"], "--context-length") == "8192"


def _decoded(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_revision_secret_holds_the_internal_token_and_both_canary_tenants_keys():
    secret = build_revision_secret(instance_for("minimal"), REVISION, CREDENTIALS)
    assert secret["immutable"] is True
    data = _decoded(secret)
    assert data["internal-token"] == CREDENTIALS.internal_token
    assert data["canary-tenant-a-key"] == CREDENTIALS.tenant_a_key
    assert data["canary-tenant-b-key"] == CREDENTIALS.tenant_b_key
    assert data["canary-api-keys"].splitlines() == [
        f"{CREDENTIALS.tenant_a_key} kvfence-canary-a",
        f"{CREDENTIALS.tenant_b_key} kvfence-canary-b",
    ]


def test_generated_credentials_are_distinct_and_unguessable():
    a, b = RevisionCredentials.generate(), RevisionCredentials.generate()
    values = {a.internal_token, a.tenant_a_key, a.tenant_b_key, b.internal_token}
    assert len(values) == 4
    assert all(len(v) >= 32 for v in values)


def test_short_credentials_are_refused():
    with pytest.raises(ValueError, match="at least 32 characters"):
        RevisionCredentials("short", "x" * 32, "y" * 32)


def _policies() -> dict[str, dict]:
    policies = build_network_policies(instance_for("minimal"), REVISION, OPERATOR_NAMESPACE)
    return {p["spec"]["podSelector"]["matchLabels"]["kvfence.dev/role"]: p for p in policies}


def _selector(role: str) -> dict:
    return {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "kvfence",
                "app.kubernetes.io/instance": "smollm",
                "kvfence.dev/revision": REVISION,
                "kvfence.dev/role": role,
            }
        }
    }


OPERATOR_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvfence-operator"}},
}


def test_network_policies_fence_only_the_engines_not_the_router():
    policies = _policies()
    assert set(policies) == {"prefill", "decode"}
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_only_the_revisions_routers_and_the_operator_reach_prefill_http():
    (rule,) = _policies()["prefill"]["spec"]["ingress"]
    assert rule["from"] == [_selector("router"), OPERATOR_PEER]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_only_the_revisions_prefill_pods_reach_decode_transfer_port():
    http_rule, transfer_rule = _policies()["decode"]["spec"]["ingress"]
    assert http_rule["from"] == [_selector("router"), OPERATOR_PEER]
    assert http_rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert transfer_rule == {
        "from": [_selector("prefill")],
        "ports": [{"protocol": "TCP", "port": 8001}],
    }


def test_canary_keys_that_start_with_a_dash_still_reach_the_canary():
    """token_urlsafe keys start with "-" one time in 32: as a separate argument argparse took
    such a key for an option, and that revision's canary failed for no isolation reason."""
    from kvfence_cli.main import build_parser

    job = build_canary_job(sample_spec("minimal"), instance_for("minimal"), REVISION)
    keys = {"KVFENCE_CANARY_TENANT_A_KEY": "-a" * 20, "KVFENCE_CANARY_TENANT_B_KEY": "--b" * 20}
    argv = container(job)["args"]
    for name, value in keys.items():  # what the kubelet's $(VAR) expansion does
        argv = [a.replace(f"$({name})", value) for a in argv]
    parsed = build_parser().parse_args(argv)
    assert (parsed.tenant_a_key, parsed.tenant_b_key) == tuple(keys.values())


def test_canary_job_reads_the_routers_metrics_with_the_revisions_internal_token():
    """The router's /metrics needs the internal token (tenants may not read it): the canary
    mounts only that key of the revision Secret, read-only, and passes the file."""
    job = build_canary_job(sample_spec("minimal"), instance_for("minimal"), REVISION, 512)
    c = container(job)
    assert flag(c["args"], "--internal-token-file") == "/var/run/kvfence/internal-token"
    volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
    assert volumes["credentials"]["secret"]["secretName"] == f"smollm-{REVISION}-credentials"
    assert volumes["credentials"]["secret"]["items"] == [
        {"key": "internal-token", "path": "internal-token"}
    ]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["credentials"] == {
        "name": "credentials",
        "mountPath": "/var/run/kvfence",
        "readOnly": True,
    }
