"""Pod specs a cluster admin accepts: every pod has CPU and memory requests (never BestEffort),
only NVIDIA resources (whole GPUs or MIG slices) mean CUDA and other vendors' are refused on
apply, router and canary pods take the user's overrides, the engines keep no float32 weights
cache in their small scratch volume, and fsGroup does not chown a volume recursively at every
start."""

import copy

import pytest
from pydantic import ValidationError

from helpers.builders import container, everything_built, flag, instance_for, pod_spec, sample_spec
from helpers.crd_admission import crd_admission, load_sample
from kvfence_engine.tools.cache_dir import WEIGHTS_CACHE_ENV
from kvfence_operator.builders.canary_job import build_canary_job
from kvfence_operator.builders.engine_deployment import build_engine_deployment
from kvfence_operator.builders.router_deployment import build_router_deployment
from kvfence_operator.crd.types import (
    EngineRoleSpec,
    InferenceDeployment,
    PodOverrides,
    Resources,
    Role,
)
from kvfence_operator.revision import revision_of

REVISION = "0123456789"
ENGINE_ROLES = [Role.PREFILL, Role.DECODE]
OVERRIDES = {
    "annotations": {"team": "inference"},
    "labels": {"tier": "gold", "kvfence.dev/role": "prefill"},
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    },
    "priorityClassName": "inference-high",
    "imagePullSecrets": [{"name": "registry-creds"}],
    "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
}


def engine_with(resources: dict | None, role: Role = Role.DECODE) -> dict:
    spec = sample_spec("minimal")
    parsed = None if resources is None else Resources.model_validate(resources)
    spec.decode = spec.prefill = EngineRoleSpec(resources=parsed)
    return build_engine_deployment(spec, instance_for("minimal"), REVISION, role)


def qos_class(pod: dict) -> str:
    """The QoS class Kubernetes gives a pod (v1 helper GetPodQOS, for cpu and memory)."""
    containers = pod["containers"]
    named = [
        {section: c.get("resources", {}).get(section, {}) for section in ("requests", "limits")}
        for c in containers
    ]
    if not any(r[s].get(name) for r in named for s in r for name in ("cpu", "memory")):
        return "BestEffort"
    guaranteed = all(
        r["limits"].get(name) is not None
        and r["requests"].get(name, r["limits"][name]) == r["limits"][name]
        for r in named
        for name in ("cpu", "memory")
    )
    return "Guaranteed" if guaranteed else "Burstable"


# ---- 1. requests by default ----------------------------------------------------------------


@pytest.mark.parametrize("sample", ["minimal", "full", "cpu-lower-context"])
def test_no_built_pod_is_best_effort(sample):
    pods = [pod_spec(m) for m in everything_built(sample) if m["kind"] in ("Deployment", "Job")]
    assert len(pods) == 4  # prefill, decode, router, canary
    assert {qos_class(p) for p in pods} <= {"Burstable", "Guaranteed"}


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_default_engines_request_cpu_and_memory_beside_their_gpu(role):
    resources = container(engine_with(None, role))["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": 1}
    assert resources["requests"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]


def test_a_gpu_only_resources_block_still_gets_cpu_and_memory_requests():
    resources = container(engine_with({"limits": {"nvidia.com/mig-1g.10gb": 1}}))["resources"]
    assert resources["limits"] == {"nvidia.com/mig-1g.10gb": 1}
    assert set(resources["requests"]) == {"cpu", "memory"}


def test_the_users_requests_and_limits_win_over_the_defaults():
    resources = container(
        engine_with({"requests": {"cpu": "8"}, "limits": {"memory": "64Gi", "nvidia.com/gpu": 1}})
    )["resources"]
    # memory: the API server defaults a missing request to the limit; adding ours could make
    # the request exceed the limit, so nothing is added
    assert resources == {
        "requests": {"cpu": "8"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": 1},
    }


def test_default_requests_do_not_pin_the_engines_threads():
    assert "--threads" not in container(engine_with(None))["args"]


# ---- 2. which resources mean CUDA --------------------------------------------------------


@pytest.mark.parametrize(
    ("resources", "device"),
    [
        (None, "cuda"),
        ({"limits": {"nvidia.com/gpu": 2}}, "cuda"),
        ({"limits": {"nvidia.com/mig-1g.10gb": 1}}, "cuda"),
        ({"requests": {"nvidia.com/mig-3g.40gb": "1"}, "limits": {"memory": "8Gi"}}, "cuda"),
        ({"limits": {"nvidia.com/mig-1g.10gb": 0, "cpu": 4}}, "cpu"),
        ({"requests": {"cpu": 4, "memory": "8Gi"}}, "cpu"),
        ({"limits": {"example.com/fpga": 1, "cpu": 2}}, "cpu"),
    ],
)
def test_whole_nvidia_gpus_and_mig_slices_run_on_cuda(resources, device):
    assert flag(container(engine_with(resources))["args"], "--device") == device


@pytest.mark.parametrize(
    "name", ["amd.com/gpu", "gpu.intel.com/i915", "gpu.intel.com/xe", "example.com/gpu"]
)
@pytest.mark.parametrize("section", ["requests", "limits"])
def test_other_vendors_gpus_are_refused_on_apply_and_by_the_operator(name, section):
    manifest = copy.deepcopy(load_sample("minimal"))
    manifest["spec"]["decode"] = {"resources": {section: {name: 1}}}
    (refusal,) = crd_admission().refusals(manifest)
    assert refusal.check == "cel"
    assert "CUDA" in refusal.message and "nvidia.com/mig-" in refusal.message
    with pytest.raises(ValidationError) as raised:
        InferenceDeployment.model_validate(manifest)
    assert refusal.message in str(raised.value)


def test_nvidia_and_cpu_resources_are_accepted():
    manifest = copy.deepcopy(load_sample("minimal"))
    manifest["spec"]["decode"] = {
        "resources": {"limits": {"nvidia.com/mig-2g.20gb": 1, "cpu": 2, "memory": "8Gi"}}
    }
    assert crd_admission().refusals(manifest) == []
    InferenceDeployment.model_validate(manifest)


# ---- 3. the weights cache ----------------------------------------------------------------


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_engines_keep_no_converted_weights_in_their_scratch_volume(role):
    env = {e["name"]: e.get("value") for e in container(engine_with(None, role))["env"]}
    assert env[WEIGHTS_CACHE_ENV] == "off"


# ---- 4. router and canary overrides ------------------------------------------------------


def spec_with_overrides() -> tuple:
    manifest = copy.deepcopy(load_sample("minimal"))
    manifest["spec"]["router"]["pod"] = OVERRIDES
    manifest["spec"]["canary"] = {"pod": OVERRIDES}
    assert crd_admission().refusals(manifest) == []
    return InferenceDeployment.model_validate(manifest).spec, instance_for("minimal")


@pytest.mark.parametrize("kind", ["router", "canary"])
def test_router_and_canary_pods_take_the_users_overrides(kind):
    spec, instance = spec_with_overrides()
    built = (
        build_router_deployment(spec, instance, REVISION)
        if kind == "router"
        else build_canary_job(spec, instance, REVISION)
    )
    template = built["spec"]["template"]
    pod = template["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == OVERRIDES["tolerations"]
    assert pod["affinity"] == OVERRIDES["affinity"]
    assert pod["priorityClassName"] == "inference-high"
    assert template["metadata"]["annotations"] == {"team": "inference"}
    assert template["metadata"]["labels"]["tier"] == "gold"
    assert template["metadata"]["labels"]["kvfence.dev/role"] == kind  # kvfence's own wins
    env = {e["name"]: e for e in container(built)["env"]}
    assert env["HTTPS_PROXY"]["value"] == "http://proxy:3128"


def test_canary_overrides_cannot_replace_the_canary_keys():
    spec, instance = spec_with_overrides()
    spec.canary.pod = PodOverrides.model_validate(
        {"env": [{"name": "KVFENCE_CANARY_TENANT_A_KEY", "value": "chosen"}]}
    )
    env = container(build_canary_job(spec, instance, REVISION))["env"]
    last = [e for e in env if e["name"] == "KVFENCE_CANARY_TENANT_A_KEY"][-1]
    assert "valueFrom" in last  # the kubelet keeps the last of duplicate names


def test_router_overrides_shape_router_pods_so_they_make_a_new_revision():
    plain, _ = sample_spec("minimal"), None
    spec, _ = spec_with_overrides()
    assert revision_of(spec) != revision_of(plain)
    manifest = copy.deepcopy(load_sample("minimal"))
    manifest["spec"]["router"]["pod"] = {}
    manifest["spec"]["canary"] = {"pod": OVERRIDES}  # the canary Job is no revision's pod
    assert revision_of(InferenceDeployment.model_validate(manifest).spec) == revision_of(plain)


# ---- 6. fsGroupChangePolicy --------------------------------------------------------------


@pytest.mark.parametrize("sample", ["minimal", "full"])
def test_fs_group_changes_ownership_only_when_the_volume_root_differs(sample):
    pods = [pod_spec(m) for m in everything_built(sample) if m["kind"] in ("Deployment", "Job")]
    assert pods
    for pod in pods:
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


# ---- 5. the router's tokenizer without the model volume ----------------------------------


def test_the_router_mounts_no_model_volume_and_reads_the_tokenizer_from_its_engines():
    """A ReadWriteOnce claim attaches to one node: a router elsewhere would never start."""
    deployment = build_router_deployment(sample_spec("full"), instance_for("full"), REVISION)
    assert {v["name"] for v in pod_spec(deployment)["volumes"]} == {"tmp", "config", "credentials"}
    assert all(m["mountPath"] != "/models" for m in container(deployment)["volumeMounts"])
    args = container(deployment)["args"]
    assert "--tokenizer-from-engines" in args
    # the engines' own tokenizer: no --model to compare with the path each engine reports
    assert "--model" not in args


def test_a_builtin_model_is_tokenized_from_the_image():
    args = container(
        build_router_deployment(sample_spec("minimal"), instance_for("minimal"), REVISION)
    )["args"]
    assert "--tokenizer-from-engines" not in args
    assert flag(args, "--model") == "builtin:smollm2-135m-instruct"
