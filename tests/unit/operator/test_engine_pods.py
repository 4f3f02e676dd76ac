"""Prefill and decode pods: GPU by default, gated on the KV pool check, and started with the
role, context, policy, pool budget, ports and internal token the spec implies."""

import pytest

from helpers.builders import container, flag, instance_for, pod_spec, sample_spec
from kvfence_operator.builders.engine_deployment import (
    build_engine_deployment,
    build_engine_service,
    engine_args,
)
from kvfence_operator.crd.types import EngineRoleSpec, PodOverrides, Resources, Role

REVISION = "0123456789"
ENGINE_ROLES = [Role.PREFILL, Role.DECODE]


def engine(sample: str, role: Role) -> dict:
    return build_engine_deployment(sample_spec(sample), instance_for(sample), REVISION, role)


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_engine_pods_ask_for_one_gpu_and_run_on_cuda_by_default(role):
    c = container(engine("minimal", role))
    assert c["resources"] == {
        "requests": {"nvidia.com/gpu": 1, "cpu": "1", "memory": "4Gi"},  # never BestEffort
        "limits": {"nvidia.com/gpu": 1},
    }
    assert flag(c["args"], "--device") == "cuda"


def test_resources_replace_the_gpu_default_and_cpu_pods_run_on_cpu():
    c = container(engine("cpu-lower-context", Role.DECODE))
    assert c["resources"] == {
        "requests": {"cpu": "500m", "memory": "2Gi"},
        "limits": {"memory": "4Gi"},
    }
    assert flag(c["args"], "--device") == "cpu"


def test_a_zero_gpu_request_means_cpu():
    spec = sample_spec("minimal")
    spec.prefill = EngineRoleSpec(resources=Resources(limits={"nvidia.com/gpu": "0"}))
    c = container(build_engine_deployment(spec, instance_for("minimal"), REVISION, Role.PREFILL))
    assert flag(c["args"], "--device") == "cpu"


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_engine_pods_wait_for_the_kv_pool_readiness_gate(role):
    assert pod_spec(engine("minimal", role))["readinessGates"] == [
        {"conditionType": "kvfence.dev/kv-pool"}
    ]


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_engine_runs_kvfence_serve_with_its_role_and_the_spec(role):
    c = container(engine("cpu-lower-context", role))
    args = c["args"]
    assert c["command"] == ["kvfence"] and args[0] == "serve"
    assert flag(args, "--role") == str(role)
    assert flag(args, "--model") == "builtin:tiny-random"
    assert flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--port") == "8000"
    assert flag(args, "--transfer-port") == "8001"
    assert flag(args, "--context-length") == "4096"
    assert flag(args, "--context-policy") == "lower"
    assert flag(args, "--kv-cache-memory") == "512Mi"
    assert "--memory-fraction" not in args
    assert flag(args, "--page-size") == "32"
    assert flag(args, "--revision") == REVISION
    assert flag(args, "--internal-token-file") == "/var/run/kvfence/internal-token"


def test_refuse_policy_and_memory_fraction_become_their_engine_flags():
    args = container(engine("full", Role.PREFILL))["args"]
    assert flag(args, "--context-policy") == "refuse"
    assert flag(args, "--memory-fraction") == "0.85"
    assert "--kv-cache-memory" not in args
    assert flag(args, "--kv-cache-dtype") == "bfloat16"
    assert "--scrub-on-free" in args
    assert "--no-kv-checksum" not in args


def test_a_default_spec_passes_no_optional_engine_flags():
    args = container(engine("minimal", Role.DECODE))["args"]
    for optional in ("--kv-cache-dtype", "--no-kv-checksum", "--scrub-on-free"):
        assert optional not in args
    assert "--kv-cache-memory" not in args and "--memory-fraction" not in args


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_the_tenant_pool_share_becomes_the_engines_flag(role):
    spec = sample_spec("minimal")
    assert "--max-pool-share-per-tenant" not in engine_args(spec, role, REVISION, "cuda")
    spec.tenant_limits.max_pool_share_per_tenant = 0.25
    args = engine_args(spec, role, REVISION, "cuda")
    assert flag(args, "--max-pool-share-per-tenant") == "0.25"


def test_disabling_kv_checksums_is_passed_to_the_engine():
    spec = sample_spec("minimal")
    spec.engine.kv_checksum = False
    assert "--no-kv-checksum" in engine_args(spec, Role.DECODE, REVISION, "cuda")


def test_extra_args_cannot_override_the_flags_the_pool_check_depends_on():
    spec = sample_spec("minimal")
    spec.engine.extra_args = ["--context-length", "999999", "--role", "combined", "--threads", "2"]
    args = engine_args(spec, Role.DECODE, REVISION, "cuda")
    assert args[1:7] == spec.engine.extra_args  # kept, right after the subcommand
    assert flag(args, "--context-length") == "2048"
    assert flag(args, "--role") == "decode"
    assert flag(args, "--threads") == "2"


def test_only_decode_exposes_the_transfer_port():
    prefill_ports = container(engine("minimal", Role.PREFILL))["ports"]
    decode_ports = container(engine("minimal", Role.DECODE))["ports"]
    assert [p["name"] for p in prefill_ports] == ["http"]
    assert {p["name"]: p["containerPort"] for p in decode_ports} == {"http": 8000, "transfer": 8001}


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_engines_mount_only_the_internal_token_from_the_revision_secret(role):
    deployment = engine("minimal", role)
    (credentials,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == "credentials"]
    assert credentials["secret"]["secretName"] == f"smollm-{REVISION}-credentials"
    assert credentials["secret"]["items"] == [{"key": "internal-token", "path": "internal-token"}]
    mount = {"name": "credentials", "mountPath": "/var/run/kvfence", "readOnly": True}
    assert mount in container(deployment)["volumeMounts"]


def test_model_volume_is_mounted_read_only_at_models():
    deployment = engine("full", Role.PREFILL)
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in pod_spec(deployment)["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container(deployment)[
        "volumeMounts"
    ]
    assert (
        flag(container(deployment)["args"], "--model") == "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def test_builtin_models_need_no_volume():
    volumes = {v["name"] for v in pod_spec(engine("minimal", Role.PREFILL))["volumes"]}
    assert volumes == {"tmp", "credentials"}


def test_pod_overrides_add_scheduling_and_metadata_but_not_labels_kvfence_selects_on():
    spec = sample_spec("full")
    spec.prefill.pod = PodOverrides.model_validate(
        {
            **spec.prefill.pod.model_dump(by_alias=True),
            "labels": {"tier": "gold", "kvfence.dev/role": "decode"},
        }
    )
    deployment = build_engine_deployment(spec, instance_for("full"), REVISION, Role.PREFILL)
    template = deployment["spec"]["template"]
    pod = template["spec"]
    assert template["metadata"]["labels"]["tier"] == "gold"
    assert template["metadata"]["labels"]["kvfence.dev/role"] == "prefill"
    assert template["metadata"]["annotations"] == {"team": "inference"}
    assert pod["nodeSelector"] == {"gpu": "a100"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["affinity"]["podAntiAffinity"]
    assert pod["topologySpreadConstraints"][0]["maxSkew"] == 1
    assert pod["priorityClassName"] == "inference-high"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    env = {e["name"]: e for e in container(deployment)["env"]}
    assert env["CUDA_MODULE_LOADING"] == {"name": "CUDA_MODULE_LOADING", "value": "LAZY"}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "KVFENCE_ALLOW_UNSAFE" not in env


def test_deployment_selects_exactly_its_revision_and_role():
    deployment = engine("full", Role.DECODE)
    assert deployment["spec"]["replicas"] == 4
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kvfence",
        "app.kubernetes.io/instance": "full",
        "kvfence.dev/revision": REVISION,
        "kvfence.dev/role": "decode",
    }
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_headless_service_publishes_only_ready_pods_of_one_revision(role):
    service = build_engine_service(instance_for("minimal"), REVISION, role)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    assert service["spec"]["selector"]["kvfence.dev/revision"] == REVISION
    assert service["spec"]["selector"]["kvfence.dev/role"] == str(role)


@pytest.mark.parametrize("builder", [build_engine_deployment, engine_args])
def test_router_is_not_an_engine_role(builder):
    spec = sample_spec("minimal")
    args: tuple[object, ...] = (spec, Role.ROUTER, REVISION, "cpu")
    if builder is build_engine_deployment:
        args = (spec, instance_for("minimal"), REVISION, Role.ROUTER)
    with pytest.raises(ValueError, match="prefill or decode"):
        builder(*args)


@pytest.mark.parametrize(
    ("resources", "threads"),
    [
        (Resources(requests={"cpu": "500m"}), "1"),  # rounded up, never 0
        (Resources(requests={"cpu": "2"}, limits={"cpu": "3"}), "3"),  # the limit, if any
        (Resources(requests={"cpu": "1.5", "memory": "2Gi"}), "2"),
        (Resources(limits={"nvidia.com/gpu": 1}), None),  # no CPU asked: torch's default
    ],
)
def test_engine_threads_follow_the_pods_cpus(resources: Resources, threads: str | None) -> None:
    spec = sample_spec("minimal")
    spec.decode = EngineRoleSpec(resources=resources)
    args = engine_args(spec, Role.DECODE, REVISION, "cpu")
    assert (flag(args, "--threads") if "--threads" in args else None) == threads
    spec.engine.extra_args = ["--threads", "8"]
    assert flag(engine_args(spec, Role.DECODE, REVISION, "cpu"), "--threads") == "8"  # user's


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_tensor_parallel_pods_ask_for_a_gpu_per_rank_and_start_their_ranks(role):
    """engine.tensorParallelSize 2: two GPUs per pod by default, `kvfence serve
    --tensor-parallel-size 2`; on CPU each rank gets its share of the pod's CPUs."""
    spec = sample_spec("minimal").model_copy(deep=True)
    spec.engine.tensor_parallel_size = 2
    c = container(build_engine_deployment(spec, instance_for("minimal"), REVISION, role))
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert flag(c["args"], "--tensor-parallel-size") == "2"
    assert flag(c["args"], "--device") == "cuda"
    on_cpu = EngineRoleSpec(resources=Resources(limits={"cpu": "4"}))
    spec.prefill = spec.decode = on_cpu
    args = engine_args(spec, role, REVISION, "cpu")
    assert flag(args, "--threads") == "2"
    assert flag(args, "--tensor-parallel-size") == "2"
    assert "--tensor-parallel-size" not in engine_args(
        sample_spec("minimal"), role, REVISION, "cpu"
    )
