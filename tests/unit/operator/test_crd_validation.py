"""A bad InferenceDeployment is refused when it is applied (generated schema + CEL rules), and
the operator's own parsing (pydantic) refuses exactly the same ones, with the same message."""

import copy
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from helpers.crd_admission import SAMPLE_NAMES, crd_admission, load_sample
from kvfence_operator.crd.types import (
    InferenceDeployment,
    InferenceDeploymentSpec,
    KvCacheDtype,
    PoolPolicy,
)


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_manifests_are_accepted_by_the_api_server_schema(name):
    assert crd_admission().refusals(load_sample(name)) == []


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_manifests_parse_into_the_models(name):
    manifest = InferenceDeployment.model_validate(load_sample(name))
    assert manifest.spec.context_length > 0


def test_minimal_spec_gets_documented_defaults():
    spec = InferenceDeployment.model_validate(load_sample("minimal")).spec
    assert spec.pool_policy is PoolPolicy.REFUSE
    assert spec.engine.page_size == 16
    assert spec.engine.kv_cache_dtype is KvCacheDtype.AUTO
    assert spec.engine.kv_checksum is True
    assert (spec.prefill.replicas, spec.decode.replicas, spec.router.replicas) == (1, 1, 1)
    assert spec.canary.enabled is True
    assert spec.prefill.resources is None  # the builders turn this into one GPU


def test_fields_are_camel_case_on_the_wire_and_snake_case_in_python():
    spec = InferenceDeploymentSpec(
        model={"source": "builtin:tiny-random"},
        context_length=512,
        router={"api_keys_secret": "keys"},
    )
    wire = spec.model_dump(by_alias=True, exclude_none=True)
    assert wire["contextLength"] == 512
    assert wire["router"]["apiKeysSecret"] == "keys"
    assert InferenceDeploymentSpec.model_validate(wire) == spec


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def mutate(manifest: dict) -> None:
        *parents, leaf = path.split(".")
        node = manifest
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def _delete(path: str) -> Callable[[dict], None]:
    def mutate(manifest: dict) -> None:
        *parents, leaf = path.split(".")
        node = manifest
        for key in parents:
            node = node[key]
        del node[leaf]

    return mutate


# (what a user did wrong, how, which schema mechanism catches it)
INVALID = [
    ("negative prefill replicas", _set("spec.prefill.replicas", -1), "openapi"),
    ("negative decode replicas", _set("spec.decode.replicas", -2), "openapi"),
    ("negative router replicas", _set("spec.router.replicas", -1), "openapi"),
    ("zero context", _set("spec.contextLength", 0), "openapi"),
    ("negative context", _set("spec.contextLength", -5), "openapi"),
    ("context as text", _set("spec.contextLength", "lots"), "openapi"),
    ("missing context", _delete("spec.contextLength"), "openapi"),
    ("missing model", _delete("spec.model"), "openapi"),
    ("missing api keys secret", _delete("spec.router.apiKeysSecret"), "openapi"),
    ("unknown pool policy", _set("spec.poolPolicy", "Shrink"), "openapi"),
    ("lower-case pool policy", _set("spec.poolPolicy", "refuse"), "openapi"),
    ("min context above context", _set("spec.minContextLength", 4096), "cel"),
    ("zero min context", _set("spec.minContextLength", 0), "openapi"),
    ("zero page size", _set("spec.engine.pageSize", 0), "openapi"),
    ("unknown KV dtype", _set("spec.engine.kvCacheDtype", "int4"), "openapi"),
    ("size without a number", _set("spec.engine.kvCacheMemory", "lots"), "openapi"),
    ("size with a bad suffix", _set("spec.engine.kvCacheMemory", "4Qi"), "openapi"),
    ("zero memory fraction", _set("spec.engine.memoryFraction", 0), "openapi"),
    ("memory fraction above one", _set("spec.engine.memoryFraction", 1.5), "openapi"),
    ("image with a space", _set("spec.engine.image", "kvfence engine"), "openapi"),
    ("relative model path", _set("spec.model.source", "models/a.gguf"), "openapi"),
    ("unknown model scheme", _set("spec.model.source", "hf:SmolLM2"), "openapi"),
    (
        "model volume with two sources",
        _set(
            "spec.model",
            {
                "source": "/models/a.gguf",
                "volume": {
                    "persistentVolumeClaim": {"claimName": "m"},
                    "nfs": {"server": "nfs.example", "path": "/m"},
                },
            },
        ),
        "openapi",
    ),
    (
        "model volume on the node's filesystem",
        _set("spec.model", {"source": "/models/a.gguf", "volume": {"hostPath": {"path": "/"}}}),
        "unknown-field",
    ),
    (
        "model volume from a Secret",
        _set("spec.model", {"source": "/models/a.gguf", "volume": {"secret": {"secretName": "s"}}}),
        "unknown-field",
    ),
    (
        "model volume claim without a name",
        _set("spec.model", {"source": "/models/a", "volume": {"persistentVolumeClaim": {}}}),
        "openapi",
    ),
    (
        "mistyped toleration effect",
        _set("spec.prefill.pod", {"tolerations": [{"key": "gpu", "effect": "NoSchedul"}]}),
        "openapi",
    ),
    (
        "misspelt toleration field",
        _set("spec.decode.pod", {"tolerations": [{"key": "gpu", "tolerationSecond": 5}]}),
        "unknown-field",
    ),
    (
        "toleration without a key or Exists",
        _set("spec.prefill.pod", {"tolerations": [{"operator": "Equal", "value": "a"}]}),
        "cel",
    ),
    (
        "toleration Exists with a value",
        _set(
            "spec.prefill.pod", {"tolerations": [{"key": "g", "operator": "Exists", "value": "a"}]}
        ),
        "cel",
    ),
    (
        "toleration seconds without NoExecute",
        _set("spec.decode.pod", {"tolerations": [{"key": "g", "tolerationSeconds": 30}]}),
        "cel",
    ),
    (
        "toleration as a string",
        _set("spec.decode.pod", {"tolerations": ["nvidia.com/gpu"]}),
        "openapi",
    ),
    (
        "node affinity operator in lower case",
        _set(
            "spec.prefill.pod",
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "gpu", "operator": "in"}]}
                            ]
                        }
                    }
                }
            },
        ),
        "openapi",
    ),
    (
        "pod anti-affinity weight zero",
        _set(
            "spec.prefill.pod",
            {
                "affinity": {
                    "podAntiAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 0, "podAffinityTerm": {"topologyKey": "zone"}}
                        ]
                    }
                }
            },
        ),
        "openapi",
    ),
    (
        "misspelt affinity kind",
        _set("spec.prefill.pod", {"affinity": {"podAntiAfinity": {}}}),
        "unknown-field",
    ),
    (
        "spread constraint without a topology key",
        _set(
            "spec.decode.pod",
            {"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]},
        ),
        "openapi",
    ),
    (
        "env from two sources",
        _set(
            "spec.decode.pod",
            {
                "env": [
                    {
                        "name": "X",
                        "valueFrom": {
                            "fieldRef": {"fieldPath": "spec.nodeName"},
                            "secretKeyRef": {"name": "s", "key": "k"},
                        },
                    }
                ]
            },
        ),
        "openapi",
    ),
    (
        "env from an unknown source",
        _set("spec.decode.pod", {"env": [{"name": "X", "valueFrom": {"secretRef": {"n": 1}}}]}),
        "unknown-field",
    ),
    (
        "extraArgs flip the KV checksum off",
        _set("spec.engine.extraArgs", ["--no-kv-checksum"]),
        "cel",
    ),
    (
        "extraArgs turn scrubbing on",
        _set("spec.engine.extraArgs", ["--scrub-on-free"]),
        "cel",
    ),
    (
        "extraArgs set the context with a value",
        _set("spec.engine.extraArgs", ["--context-length=65536"]),
        "cel",
    ),
    (
        "extraArgs set the context abbreviated",
        _set("spec.engine.extraArgs", ["--context-len", "65536"]),
        "cel",
    ),
    (
        "extraArgs set the pool budget",
        _set("spec.engine.extraArgs", ["--kv-cache-memory", "100Gi"]),
        "cel",
    ),
    (
        "extraArgs set the pool share",
        _set("spec.engine.extraArgs", ["--max-pool-share-per-tenant=1"]),
        "cel",
    ),
    ("extraArgs set the device", _set("spec.engine.extraArgs", ["--device", "cuda"]), "cel"),
    ("extraArgs set the port", _set("spec.engine.extraArgs", ["--port=9000"]), "cel"),
    ("extraArgs set the role", _set("spec.engine.extraArgs", ["--role", "both"]), "cel"),
    ("service port zero", _set("spec.router.service.port", 0), "openapi"),
    ("unknown service type", _set("spec.router.service.type", "Ingress"), "openapi"),
    ("bad secret name", _set("spec.router.apiKeysSecret", "Keys_Secret"), "openapi"),
    ("canary timeout zero", _set("spec.canary.timeoutSeconds", 0), "openapi"),
    ("zero concurrent requests", _set("spec.tenantLimits.maxConcurrentRequests", 0), "openapi"),
    ("zero pool share", _set("spec.tenantLimits.maxPoolSharePerTenant", 0), "openapi"),
    ("pool share above one", _set("spec.tenantLimits.maxPoolSharePerTenant", 1.5), "openapi"),
    ("unknown tenant limit", _set("spec.tenantLimits.maxTokensPerMinute", 10), "unknown-field"),
    (
        "bad GPU quantity",
        _set("spec.prefill.resources", {"limits": {"nvidia.com/gpu": "one"}}),
        "openapi",
    ),
    ("misspelt field", _set("spec.contextLenght", 2048), "unknown-field"),
    ("unknown engine field", _set("spec.engine.kvCacheBytes", 10), "unknown-field"),
    (
        "both pool budgets",
        lambda m: m["spec"].update(engine={"kvCacheMemory": "1Gi", "memoryFraction": 0.5}),
        "cel",
    ),
    (
        "unsafe fault through extraArgs",
        _set("spec.engine.extraArgs", ["--unsafe-fault", "no-tag-check"]),
        "cel",
    ),
    ("abbreviated unsafe fault", _set("spec.engine.extraArgs", ["--unsafe=late-write"]), "cel"),
    (
        "unsafe env through pod overrides",
        _set("spec.decode.pod", {"env": [{"name": "KVFENCE_ALLOW_UNSAFE", "value": "1"}]}),
        "cel",
    ),
    (
        "model volume but path outside it",
        lambda m: m["spec"].update(
            model={
                "source": "/data/a.gguf",
                "volume": {"persistentVolumeClaim": {"claimName": "m"}},
            }
        ),
        "cel",
    ),
    (
        "two ranks on one GPU",
        lambda m: m["spec"].update(
            engine={"tensorParallelSize": 2},
            decode={"resources": {"limits": {"nvidia.com/gpu": 1}}},
        ),
        "cel",
    ),
    (
        "one rank on two GPUs",
        _set("spec.prefill", {"resources": {"requests": {"nvidia.com/gpu": "2"}}}),
        "cel",
    ),
    ("no ranks", _set("spec.engine", {"tensorParallelSize": 0}), "openapi"),
    (
        "autoscaling min over max",
        _set(
            "spec.autoscaling",
            {
                "decode": {
                    "minReplicas": 4,
                    "maxReplicas": 2,
                    "signal": "RunningSequences",
                    "target": 8,
                }
            },
        ),
        "cel",
    ),
    (
        "prefill scaling on a decode signal",
        _set(
            "spec.autoscaling",
            {"prefill": {"maxReplicas": 2, "signal": "RunningSequences", "target": 8}},
        ),
        "cel",
    ),
    (
        "a ratio no counts within the bounds meet",
        _set(
            "spec.autoscaling",
            {
                "prefill": {"maxReplicas": 2, "signal": "QueuedPromptTokens", "target": 512},
                "decode": {
                    "minReplicas": 3,
                    "maxReplicas": 4,
                    "signal": "RunningSequences",
                    "target": 8,
                },
                "prefillToDecodeRatio": {"min": 1, "max": 2},
            },
        ),
        "cel",
    ),
    (
        "a pool utilization target over 1",
        _set(
            "spec.autoscaling",
            {"decode": {"maxReplicas": 2, "signal": "KvPoolUtilization", "target": 2}},
        ),
        "cel",
    ),
    ("name too long for its children", _set("metadata.name", "x" * 41), "openapi"),
    ("name starting with a digit", _set("metadata.name", "1model"), "openapi"),
]


@pytest.mark.parametrize(
    ("mutate", "caught_by"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID]
)
def test_invalid_manifest_is_refused_on_apply_and_by_the_operator(mutate, caught_by):
    manifest = copy.deepcopy(load_sample("minimal"))
    mutate(manifest)
    refusals = crd_admission().refusals(manifest)
    assert refusals, "the API server would have accepted this manifest"
    assert {r.check for r in refusals} == {caught_by}, refusals
    with pytest.raises(ValidationError):
        InferenceDeployment.model_validate(manifest)


CEL_CASES = [case for case in INVALID if case[2] == "cel"]


@pytest.mark.parametrize("mutate", [c[1] for c in CEL_CASES], ids=[c[0] for c in CEL_CASES])
def test_cel_rule_and_pydantic_validator_give_the_same_message(mutate):
    manifest = copy.deepcopy(load_sample("minimal"))
    mutate(manifest)
    (refusal,) = crd_admission().refusals(manifest)
    with pytest.raises(ValidationError) as raised:
        InferenceDeployment.model_validate(manifest)
    assert refusal.message in str(raised.value)


def _edge_values() -> dict:
    """Boundaries both must accept: scaled to zero, minContextLength == contextLength,
    memoryFraction of exactly 1, extra args that are not fault switches."""
    manifest = load_sample("cpu-lower-context")
    manifest["spec"]["prefill"]["replicas"] = 0
    manifest["spec"]["minContextLength"] = manifest["spec"]["contextLength"]
    manifest["spec"]["engine"] = {
        "memoryFraction": 1,
        # flags the spec does not derive, even those sharing a prefix with one it does
        "extraArgs": [
            "--threads", "2", "--max-num-seqs", "8", "--max-batched-tokens=512",
            "--transfer-max-connections", "4", "--reserve-timeout", "5", "--weight-dtype",
            "float32", "--max-waiting", "16",
        ],
    }  # fmt: skip
    manifest["spec"]["tenantLimits"] = {"maxConcurrentRequests": 1, "maxPoolSharePerTenant": 1}
    # two ranks per pod: two GPUs where a role names them, CPU where it names none
    manifest["spec"]["engine"]["tensorParallelSize"] = 2
    manifest["spec"]["decode"] = {"resources": {"limits": {"nvidia.com/gpu": 2, "cpu": "4"}}}
    # whole numbers where a fraction may go (JSON keeps 2.0 as 2): the rules compare doubles
    manifest["spec"]["autoscaling"] = {
        "prefill": {"maxReplicas": 2, "signal": "TimeToFirstToken", "target": 1},
        "decode": {"maxReplicas": 4, "signal": "KvPoolUtilization", "target": 1},
        "prefillToDecodeRatio": {"min": 0.5, "max": 2},
    }
    return manifest


def test_boundary_values_are_accepted_on_apply_and_by_the_operator():
    manifest = _edge_values()
    assert crd_admission().refusals(manifest) == []
    InferenceDeployment.model_validate(manifest)


def test_pydantic_error_names_the_wrong_value():
    manifest = load_sample("cpu-lower-context")
    manifest["spec"]["minContextLength"] = 9000
    with pytest.raises(ValidationError, match="9000 > 4096"):
        InferenceDeployment.model_validate(manifest)


@pytest.mark.parametrize(
    "volume",
    [
        {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        {"image": {"reference": "registry.example/models/smollm2:1", "pullPolicy": "IfNotPresent"}},
        {"csi": {"driver": "s3.csi.aws.com", "volumeAttributes": {"bucketName": "models"}}},
        {"nfs": {"server": "nfs.example", "path": "/exports/models", "readOnly": True}},
    ],
    ids=lambda v: next(iter(v)),
)
def test_allowed_model_volume_types_are_accepted_and_reach_the_pod_unchanged(volume):
    manifest = load_sample("minimal")
    manifest["spec"]["model"] = {"source": "/models/m.gguf", "volume": volume}
    assert crd_admission().refusals(manifest) == []
    spec = InferenceDeployment.model_validate(manifest).spec
    assert spec.model.volume is not None
    assert {**spec.model.volume, "name": "model"} == {**volume, "name": "model"}


def test_a_refused_model_volume_type_is_named_with_the_allowed_ones():
    manifest = load_sample("minimal")
    manifest["spec"]["model"] = {"source": "/models/m", "volume": {"hostPath": {"path": "/"}}}
    with pytest.raises(ValidationError, match="hostPath is not an allowed volume type; use one of "
                       "persistentVolumeClaim, image, csi, nfs"):  # fmt: skip
        InferenceDeployment.model_validate(manifest)


def test_extra_args_refusal_names_the_spec_field_to_use():
    manifest = load_sample("minimal")
    manifest["spec"]["engine"] = {"extraArgs": ["--no-kv-checksum"]}
    (refusal,) = crd_admission().refusals(manifest)
    assert refusal.message == (
        "extraArgs must not set --kv-checksum or --no-kv-checksum: set engine.kvChecksum instead"
    )


def test_env_may_read_a_secret_key_as_a_pod_may():
    """Documented, not limited: docs/crd.md "Who may create one"."""
    manifest = load_sample("minimal")
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    manifest["spec"]["decode"] = {"pod": {"env": env}}
    assert crd_admission().refusals(manifest) == []
    pod = InferenceDeployment.model_validate(manifest).spec.decode.pod
    assert pod.model_dump(by_alias=True, exclude_none=True)["env"] == env
