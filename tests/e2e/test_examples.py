"""The manifests in examples/ are what users apply first: each one must pass the API server's
checks (CRD schema + CEL rules, stand-in in tests/helpers/crd_admission.py) and the operator's
own model, build valid children, and do what its comments promise. The Argo CD health check
and the Flux CEL expressions in examples/gitops.md give the right verdict for real statuses."""

import re
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from gguf import GGUFReader
from lupa import lua51

from helpers.crd_admission import crd_admission
from helpers.rollout import observation
from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.pool_plan import ContextPolicy, effective_context, plan_pool
from kvfence_engine.core.shards import plan_shards, rank_config
from kvfence_engine.loading.tokenizer_source import smollm2_gguf_path
from kvfence_engine.router.keys import parse_keys_files
from kvfence_engine.tools.units import parse_size
from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.canary_job import build_canary_job
from kvfence_operator.builders.pod_template import GPU_RESOURCE
from kvfence_operator.builders.router_deployment import build_stable_service
from kvfence_operator.builders.secret import USER_API_KEYS_KEY, RevisionCredentials
from kvfence_operator.crd.types import (
    API_GROUP,
    KIND,
    ConditionReason,
    InferenceDeployment,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    PoolPolicy,
    RevisionStatus,
    RoleReplicas,
)
from kvfence_operator.decisions.findings import Problem
from kvfence_operator.decisions.rollout import (
    CanaryOutcome,
    JobPhase,
    RevisionObservation,
    plan_rollout,
)
from kvfence_operator.decisions.status import compute_status
from kvfence_operator.meta import Instance
from kvfence_operator.revision import revision_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MANIFESTS = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
KUBERNETES_VERSION = "1.30"


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d is not None]


def inference_deployment(name: str) -> dict[str, Any]:
    (found,) = [d for d in documents(name) if d["kind"] == KIND]
    return found


def spec_of(name: str) -> InferenceDeploymentSpec:
    return InferenceDeployment.model_validate(inference_deployment(name)).spec


def test_the_examples_are_the_ones_documented() -> None:
    assert MANIFESTS == [
        "cpu-cluster.yaml",
        "gpu-cluster.yaml",
        "lower-context.yaml",
        "smollm2-local.yaml",
        "smollm2-tp2-local.yaml",
    ]


@pytest.mark.parametrize("name", MANIFESTS)
def test_example_passes_the_api_servers_checks_and_the_operators_model(name: str) -> None:
    manifest = inference_deployment(name)
    assert crd_admission().refusals(manifest) == []
    InferenceDeployment.model_validate(manifest)


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_other_document_is_a_valid_kubernetes_object(name: str) -> None:
    for doc in documents(name):
        if doc["kind"] != KIND:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_operator_builds_valid_objects_from_the_example(name: str) -> None:
    manifest = inference_deployment(name)
    spec = InferenceDeployment.model_validate(manifest).spec
    instance = Instance(manifest["metadata"]["name"], "inference", "uid-1")
    revision = revision_of(spec)
    credentials = RevisionCredentials.generate()
    built = [
        *build_revision_children(spec, instance, revision, credentials, "kvfence-system"),
        build_canary_job(spec, instance, revision),
        build_stable_service(spec, instance, revision),
    ]
    for obj in built:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


# ---- what each example promises -----------------------------------------------------------


@cache
def smollm2_config() -> ModelConfig:
    """SmolLM2's KV shape, read from the GGUF the builtin model ships (not restated here)."""
    fields = GGUFReader(str(smollm2_gguf_path())).fields

    def value(key: str) -> int:
        field = fields[key]
        return int(field.parts[field.data[0]][0])

    heads = value("llama.attention.head_count")
    return ModelConfig(
        vocab_size=value("llama.vocab_size"),
        hidden_size=value("llama.embedding_length"),
        intermediate_size=0,
        num_layers=value("llama.block_count"),
        num_heads=heads,
        num_kv_heads=value("llama.attention.head_count_kv"),
        head_dim=value("llama.embedding_length") // heads,
        rope_theta=0.0,
        rms_eps=0.0,
        max_positions=value("llama.context_length"),
        tie_embeddings=True,
    )


def pool_tokens(spec: InferenceDeploymentSpec, dtype_bytes: int) -> int:
    assert spec.engine.kv_cache_memory is not None, "a fixed budget is what makes this checkable"
    plan = plan_pool(
        smollm2_config(),
        page_size=spec.engine.page_size,
        dtype_bytes=dtype_bytes,
        budget_bytes=parse_size(spec.engine.kv_cache_memory),
    )
    return plan.pool_tokens


def uses_gpus(spec: InferenceDeploymentSpec) -> bool:
    roles = (spec.prefill, spec.decode)
    return all(
        r.resources is not None
        and GPU_RESOURCE in r.resources.limits
        and GPU_RESOURCE in r.resources.requests
        for r in roles
    )


def test_local_example_fits_a_cpu_laptop_and_its_pool_holds_the_context() -> None:
    spec = spec_of("smollm2-local.yaml")
    assert spec.model.source == "builtin:smollm2-135m-instruct"
    for role in (spec.prefill, spec.decode):
        assert role.replicas == 1
        assert role.resources is not None
        assert GPU_RESOURCE not in {**role.resources.requests, **role.resources.limits}
    assert spec.router.replicas == 1 and spec.canary.enabled
    assert spec.pool_policy is PoolPolicy.REFUSE
    assert spec.context_length <= smollm2_config().max_positions
    # On CPU the KV cache is float32 (kvCacheDtype auto): 4 bytes per value.
    tokens = pool_tokens(spec, dtype_bytes=4)
    assert spec.context_length <= tokens < 2 * 4096, tokens  # holds the context, and is small
    assert f"holds {tokens} tokens" in (EXAMPLES / "smollm2-local.yaml").read_text()


def test_the_tensor_parallel_example_is_the_local_one_split_over_two_ranks() -> None:
    """smollm2-tp2-local.yaml is smollm2-local.yaml with tensorParallelSize 2 (and its name):
    SmolLM2 splits over two ranks, and the pool of the rank with the most KV heads holds the
    context, as its comment says."""
    spec, local = spec_of("smollm2-tp2-local.yaml"), spec_of("smollm2-local.yaml")
    assert spec.engine.tensor_parallel_size == 2
    assert spec.model == local.model and spec.context_length == local.context_length
    assert not uses_gpus(spec)
    ranks = plan_shards(smollm2_config(), 2)
    assert [r.kv_heads.size for r in ranks] == [2, 1]
    widest = rank_config(smollm2_config(), ranks[0])
    budget = parse_size(spec.engine.kv_cache_memory or "")
    plan = plan_pool(widest, page_size=spec.engine.page_size, dtype_bytes=4, budget_bytes=budget)
    tokens = plan.num_pages * spec.engine.page_size
    assert spec.context_length <= tokens
    text = (EXAMPLES / "smollm2-tp2-local.yaml").read_text()
    assert f"holds {tokens:,} tokens" in text, tokens


def test_gpu_example_runs_two_decode_pods_on_gpus_behind_its_api_keys_secret(
    tmp_path: Path,
) -> None:
    spec = spec_of("gpu-cluster.yaml")
    assert uses_gpus(spec)
    assert spec.decode.replicas == 2
    assert spec.pool_policy is PoolPolicy.REFUSE
    assert spec.engine.memory_fraction is not None and 0.5 <= spec.engine.memory_fraction <= 0.95
    (secret,) = [d for d in documents("gpu-cluster.yaml") if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == spec.router.api_keys_secret
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(secret["stringData"][USER_API_KEYS_KEY])
    # The router reads it (it is well-formed) and finds no key: nothing served with a key
    # everybody can read in this repository.
    assert parse_keys_files([str(keys_file)]) == {}


def test_lower_context_example_really_serves_a_lowered_context() -> None:
    spec = spec_of("lower-context.yaml")
    assert spec.pool_policy is PoolPolicy.LOWER_CONTEXT
    assert spec.min_context_length is not None
    assert spec.engine.kv_cache_dtype == "bfloat16"
    tokens = pool_tokens(spec, dtype_bytes=2)
    served = effective_context(
        spec.context_length, tokens, spec.engine.page_size, ContextPolicy.LOWER
    )
    assert spec.min_context_length <= served < spec.context_length
    text = (EXAMPLES / "lower-context.yaml").read_text()
    assert f"holds {tokens} tokens" in text and f"serves {served}" in text


# ---- GitOps health checks -----------------------------------------------------------------

HEALTHY, PROGRESSING, DEGRADED = "Healthy", "Progressing", "Degraded"


def condition(type_: str, status: str, message: str = "", generation: int = 2) -> dict:
    return {
        "type": type_,
        "status": status,
        "reason": "Testing",
        "message": message,
        "lastTransitionTime": "2026-11-29T12:00:00Z",
        "observedGeneration": generation,
    }


def infd(generation: int, status: dict | None) -> dict:
    obj: dict[str, Any] = {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": KIND,
        "metadata": {"name": "smollm", "namespace": "inference", "generation": generation},
        "spec": {"contextLength": 8192},
    }
    if status is not None:
        obj["status"] = status
    return obj


SERVING = condition("Ready", "True", "Serving revision abc12 at 8192 tokens")
# (name, object, verdict, message)
HEALTH_CASES = [
    ("no status yet", infd(1, None), PROGRESSING, "Waiting for the kvfence operator"),
    (
        "serving the latest spec",
        infd(2, {"observedGeneration": 2, "conditions": [SERVING]}),
        HEALTHY,
        "Serving revision abc12",
    ),
    (
        "new spec not observed yet",
        infd(3, {"observedGeneration": 2, "conditions": [SERVING]}),
        PROGRESSING,
        "observe generation 3",
    ),
    (
        "new revision being canaried while the old one serves",
        infd(
            2,
            {
                "observedGeneration": 2,
                "conditions": [
                    SERVING,
                    condition("Progressing", "True", "Canary job smollm-def34-canary running"),
                ],
            },
        ),
        PROGRESSING,
        "Canary job smollm-def34-canary running",
    ),
    (
        "canary failed: the old revision keeps serving",
        infd(
            2,
            {
                "observedGeneration": 2,
                "conditions": [
                    SERVING,
                    condition("Progressing", "False"),
                    condition("CanaryPassed", "False", "tenant B saw tenant A's marker"),
                ],
            },
        ),
        DEGRADED,
        "tenant B saw tenant A's marker",
    ),
    (
        "degraded",
        infd(
            2,
            {
                "observedGeneration": 2,
                "conditions": [
                    condition("Ready", "False", "no decode pod holds 8192 tokens"),
                    condition("Degraded", "True", "pool of decode-0 holds 4096 < 8192 tokens"),
                ],
            },
        ),
        DEGRADED,
        "pool of decode-0 holds 4096 < 8192 tokens",
    ),
    (
        "pods starting",
        infd(
            1,
            {
                "observedGeneration": 1,
                "conditions": [condition("Ready", "False", "0/2 decode pods ready", 1)],
            },
        ),
        PROGRESSING,
        "0/2 decode pods ready",
    ),
    (
        "scaled to zero, as the spec asks",
        infd(
            2,
            {
                "observedGeneration": 2,
                "conditions": [
                    {
                        **condition("Ready", "False", "spec.decode.replicas is 0: scaled to zero"),
                        "reason": "ScaledToZero",
                    },
                    condition("Degraded", "False"),
                    condition("Progressing", "False"),
                ],
            },
        ),
        HEALTHY,
        "scaled to zero",
    ),
    (
        "Ready written for an older generation",
        infd(
            3,
            {"observedGeneration": 3, "conditions": [condition("Ready", "True", "old", 2)]},
        ),
        PROGRESSING,
        "Waiting for Ready on generation 3",
    ),
]
CASE_IDS = [case[0] for case in HEALTH_CASES]


def argocd_health(obj: dict) -> dict[str, str]:
    """Runs the check as Argo CD does: Lua 5.1 (gopher-lua), the object as global `obj`."""
    lua = lua51.LuaRuntime()
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute((EXAMPLES / "argocd-health.lua").read_text())
    return dict(result.items())


@pytest.mark.parametrize(("name", "obj", "verdict", "message"), HEALTH_CASES, ids=CASE_IDS)
def test_argocd_health_check_verdict(name: str, obj: dict, verdict: str, message: str) -> None:
    health = argocd_health(obj)
    assert health["status"] == verdict, (name, health)
    assert message in health["message"], (name, health)


def test_gitops_note_installs_the_lua_check_under_argocd_s_key_for_our_kind() -> None:
    note = (EXAMPLES / "gitops.md").read_text()
    assert f"resource.customizations.health.{API_GROUP}_{KIND}:" in note
    assert "kubectl wait --for=condition=Ready infd/" in note


def flux_health_check_exprs() -> dict[str, str]:
    note = (EXAMPLES / "gitops.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", note, re.DOTALL)
    (kustomization,) = [yaml.safe_load(b) for b in blocks if "healthCheckExprs" in b]
    (exprs,) = kustomization["spec"]["healthCheckExprs"]
    assert (exprs["apiVersion"], exprs["kind"]) == (f"{API_GROUP}/v1alpha1", KIND)
    return exprs


def flux_health(obj: dict) -> str:
    """kstatus' generation check, then the CEL expressions in Flux's order; an expression that
    cannot be evaluated (no status yet) matches nothing, so Flux keeps waiting."""
    generation = obj["metadata"].get("generation")
    observed = obj.get("status", {}).get("observedGeneration")
    if observed is not None and observed != generation:
        return "InProgress"
    env = celpy.Environment()
    activation = {key: celpy.json_to_cel(value) for key, value in obj.items()}
    for verdict, key in (
        ("InProgress", "inProgress"),
        ("Failed", "failed"),
        ("Current", "current"),
    ):
        expr = flux_health_check_exprs().get(key)
        if expr is None:
            continue
        result = env.program(env.compile(expr)).evaluate(activation)
        if not isinstance(result, Exception) and bool(result):
            return verdict
    return "InProgress"


FLUX_FOR_ARGO = {HEALTHY: "Current", PROGRESSING: "InProgress", DEGRADED: "Failed"}


@pytest.mark.parametrize(("name", "obj", "verdict", "message"), HEALTH_CASES, ids=CASE_IDS)
def test_flux_health_check_exprs_agree_with_the_argocd_check(
    name: str, obj: dict, verdict: str, message: str
) -> None:
    assert flux_health(obj) == FLUX_FOR_ARGO[verdict], name


# ---- the checks on statuses the operator computes ----------------------------------------


def computed_cases() -> list[tuple[str, dict, str]]:
    """(name, object, Argo CD verdict) for statuses `compute_status` itself writes: Ready is a
    Deployment's Available (True during a rollout and a scale-up), so the checks must read
    Progressing and Degraded first to say Progressing and Degraded there."""
    spec = InferenceDeploymentSpec.model_validate(
        {"model": {"source": "builtin:tiny-random"}, "contextLength": 512,
         "router": {"apiKeysSecret": "k"}}
    )  # fmt: skip
    r1, failed = observation("r1"), CanaryOutcome("j", JobPhase.FAILED, "kvfence canary FAIL")
    seen = r1.replicas
    scaling = RevisionObservation("r1", {**seen, "decode": RoleReplicas(ready=2, desired=3)},
                                  r1.pools)  # fmt: skip
    crash = Problem(ConditionReason.ENGINE_CRASH_LOOPING, "engine pods crash-loop: no such file")
    serving = RevisionStatus(current="r1")
    rolling = RevisionStatus(current="r1", candidate="r2")
    cases = [
        ("serving", "r1", serving, {"r1": r1}, (), HEALTHY),
        ("a rollout, the old revision serving", "r2", rolling,
         {"r1": r1, "r2": observation("r2", ready=0)}, (), PROGRESSING),
        ("a failed canary, the old revision serving", "r2", rolling,
         {"r1": r1, "r2": observation("r2", canary=failed)}, (), DEGRADED),
        ("a scale-up", "r1", serving, {"r1": scaling}, (), PROGRESSING),
        ("a first rollout", "r1", None, {"r1": observation("r1", ready=0)}, (), PROGRESSING),
        ("a crash-looping engine", "r1", None, {"r1": observation("r1", ready=0)}, (crash,),
         DEGRADED),
    ]  # fmt: skip
    out = []
    for name, desired, revision, observed, problems, verdict in cases:
        plan = plan_rollout(desired, revision, None, observed, True)
        status = compute_status(
            spec, 2, InferenceDeploymentStatus(), plan, observed, [], "http://x", problems=problems
        )
        out.append((name, infd(2, status.model_dump(mode="json", by_alias=True)), verdict))
    return out


def test_both_checks_judge_the_statuses_the_operator_computes() -> None:
    for name, obj, verdict in computed_cases():
        assert argocd_health(obj)["status"] == verdict, (name, argocd_health(obj))
        assert flux_health(obj) == FLUX_FOR_ARGO[verdict], name
