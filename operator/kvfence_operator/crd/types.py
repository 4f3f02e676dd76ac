"""The InferenceDeployment API (kvfence.dev/v1alpha1) as pydantic models.

The CRD schema is generated from these models (see crd/schema.py), so a constraint written here is
enforced twice: by the API server when a user applies a manifest, and by `model_validate` when
the operator or `kvfence up` reads one. Cross-field rules are CEL rules in the schema
(`x-kubernetes-validations`) and the same check as a pydantic validator, with the same message.
"""

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    computed_field,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kvfence_engine.tools.units import SIZE_GRAMMAR, SIZE_PATTERN, parse_size
from kvfence_operator.crd.core_v1 import (
    MODEL_VOLUME_TYPES,
    Affinity,
    EnvVarSource,
    ModelVolume,
    Quantity,
    Toleration,
    TopologySpreadConstraint,
    cel,
)
from kvfence_operator.crd.schedule import PATTERN as SCHEDULE_PATTERN
from kvfence_operator.crd.schedule import parse as parse_schedule

API_GROUP = "kvfence.dev"
API_VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAME = "infd"
# `kubectl get kvfence` lists them. Not in `all`: `kubectl delete all --all` would then delete
# the InferenceDeployments themselves, not only their (recreated) children.
CATEGORIES = ["kvfence"]

DEFAULT_ENGINE_IMAGE = "ghcr.io/kvfence/kvfence-engine:0.1.0"
MODEL_MOUNT_PATH = "/models"
# Children are named <name>-<revision>-<component>; Service names are DNS-1035 labels of at
# most 63 characters, which leaves 40 for the InferenceDeployment's own name.
NAME_MAX_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
UNSAFE_ENV = "KVFENCE_ALLOW_UNSAFE"
# argparse accepts any unambiguous prefix of a long option, and `kvfence serve` has a single
# option starting with --u, so this prefix catches --unsafe-fault and all its abbreviations.
UNSAFE_FLAG_PREFIX = "--u"
# `kvfence serve` flags that engine_args derives from the spec (or sets itself), with what to
# write instead: the spec wins over extraArgs in both directions, so extraArgs may not name
# them, in either form (--x, --no-x), with a value (--x=v) or abbreviated as argparse takes it.
# --threads is not here: it comes from the pod's CPU and extraArgs may override it on purpose.
MAX_TENSOR_PARALLEL = 16  # ranks per engine pod: GPUs of one node
SPEC_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--model",), "set model.source instead"),
    (("--context-length",), "set contextLength instead"),
    (("--context-policy",), "set poolPolicy instead"),
    (
        ("--kv-cache-memory", "--memory-fraction"),
        "set engine.kvCacheMemory or engine.memoryFraction instead",
    ),
    (("--page-size",), "set engine.pageSize instead"),
    (("--tensor-parallel-size",), "set engine.tensorParallelSize instead"),
    (("--kv-cache-dtype",), "set engine.kvCacheDtype instead"),
    (("--kv-checksum", "--no-kv-checksum"), "set engine.kvChecksum instead"),
    (("--scrub-on-free", "--no-scrub-on-free"), "set engine.scrubOnFree instead"),
    (("--max-pool-share-per-tenant",), "set tenantLimits.maxPoolSharePerTenant instead"),
    (
        ("--prefix-cache", "--no-prefix-cache", "--prefix-cache-secret-file"),
        "set engine.prefixCache.enabled instead (the operator makes the secret)",
    ),
    (("--device",), "it follows prefill/decode resources (cuda with a */gpu resource)"),
    # main's promotion drain (issue #14) passes it from rollout.terminationGracePeriodSeconds
    (("--drain-seconds",), "set rollout.terminationGracePeriodSeconds instead"),
    (
        (
            "--role",
            "--host",
            "--port",
            "--transfer-port",
            "--revision",
            "--internal-token-file",
            "--metrics-token-sha256",
            "--termination-log",
        ),
        "the operator sets them for each pod",
    ),
    (("--listen-fd",), "the operator sets --host and --port, which it would replace"),
)


def _abbreviations(flag: str) -> str:
    """A regex for `flag` and every prefix argparse could take for it (at least one letter after
    the dashes): --role is --r(o(le?)?)?, as nested optional groups."""
    pattern = ""
    for char in reversed(flag[3:]):
        pattern = f"(?:{char}{pattern})?" if pattern else f"{char}?"
    return flag[:3] + pattern


def spec_flag_pattern(flags: tuple[str, ...]) -> str:
    """Matches an extraArg that sets one of `flags` (RE2 and Python agree on it)."""
    names = "|".join(_abbreviations(f) for f in flags)
    return f"^(?:{names})(?:=|$)"


def spec_flag_message(flags: tuple[str, ...], instead: str) -> str:
    return f"extraArgs must not set {' or '.join(flags)}: {instead}"


# On an object-valued field whose model has defaults: `default: {}` in the CRD, so that the API
# server writes the object, with its fields' defaults, into a spec that omits it. Defaults then
# live in the stored object from its creation, not in the code that reads it (a later release
# that changes one changes no existing object, and no revision:
# kvfence_operator/revision.py).
OBJECT_DEFAULT: dict[str, Any] = {"json_schema_extra": {"default": {}}}


class _ApiModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class PoolPolicy(StrEnum):
    REFUSE = "Refuse"  # a pod whose pool cannot hold contextLength never becomes Ready
    LOWER_CONTEXT = "LowerContext"  # serve the smallest pool's context, down to minContextLength


class KvCacheDtype(StrEnum):
    AUTO = "auto"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class ServiceType(StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class Role(StrEnum):
    """The parts of an InferenceDeployment (the kvfence.dev/role label, child names). Not the
    engine's kvfence_engine.contracts.Role, what `kvfence serve --role` runs: router and canary
    are no engines, and the operator never runs a combined one."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"
    CANARY = "canary"


class ModelSpec(_ApiModel):
    """Which model the engines load."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                f"!has(self.volume) || self.source.startsWith('{MODEL_MOUNT_PATH}/')",
                f"with a model volume, source must be a path under {MODEL_MOUNT_PATH}/ "
                "(where the volume is mounted)",
            )
        )
    )

    name: str | None = Field(
        None,
        max_length=256,
        description="Model id the router advertises; defaults to the name the engine reports.",
    )
    source: str = Field(
        pattern=r"^(builtin:[a-z0-9][-a-z0-9._]*|/.+)$",
        max_length=1024,
        description="builtin:smollm2-135m-instruct, builtin:tiny-random, or an absolute path to "
        "a .gguf file or a folder with config.json + safetensors.",
    )
    volume: ModelVolume | None = Field(
        None,
        description=f"One volume source, of type {', '.join(MODEL_VOLUME_TYPES)} (e.g. "
        "persistentVolumeClaim: {claimName: m}), mounted read-only at "
        f"{MODEL_MOUNT_PATH} in engine and router pods.",
    )

    @model_validator(mode="after")
    def _source_inside_volume(self) -> "ModelSpec":
        if self.volume is not None and not self.source.startswith(f"{MODEL_MOUNT_PATH}/"):
            raise ValueError(
                f"with a model volume, source must be a path under {MODEL_MOUNT_PATH}/ "
                f"(where the volume is mounted), got {self.source!r}"
            )
        return self


ExtraArg = Annotated[str, Field(max_length=1024)]


class PrefixCacheSpec(_ApiModel):
    """Reuse of a prompt's leading KV pages within a tenant (docs/isolation.md #11)."""

    enabled: bool = Field(
        False,
        strict=True,  # as the API server: "yes" or 1 is not a boolean
        description="Prefill engines keep the KV of prompts' full pages and reuse it for later "
        "prompts of the same tenant that begin alike; the router then routes prefix-aware "
        "within a tenant. Off by default: within a tenant, a hit shows in usage.cached_tokens "
        "and a faster first token, so anyone holding the tenant's key can tell whether a "
        "prefix was sent before (docs/crd.md).",
    )
    # Unset: the engine's own defaults (`kvfence serve --prefix-cache-*`). No schema default,
    # so an object stored before these fields existed keeps its revision.
    share: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="The share of each prefill pod's KV pool that is the cache's and never a "
        "request's (kvfence serve --prefix-cache-share; unset: 0.25).",
    )
    tenants: int | None = Field(
        None,
        ge=1,
        description="Tenants that may hold cached pages on a pod at once, each up to share / "
        "tenants of its pool and evicting only its own (unset: 8).",
    )
    idle_seconds: int | None = Field(
        None,
        ge=1,
        description="A cached page no request used for this long leaves the cache (unset: 600).",
    )


class EngineSpec(_ApiModel):
    """How each engine pod runs and sizes its KV pool."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!(has(self.kvCacheMemory) && has(self.memoryFraction))",
                "set kvCacheMemory or memoryFraction, not both",
            )
        )
    )

    image: str = Field(DEFAULT_ENGINE_IMAGE, pattern=r"^\S+$", max_length=1024)
    page_size: int = Field(16, ge=1, description="Tokens per KV page.")
    kv_cache_dtype: KvCacheDtype = Field(
        KvCacheDtype.AUTO, description="auto: float32 on CPU, bfloat16 on GPU."
    )
    kv_cache_memory: str | None = Field(
        None,
        pattern=SIZE_PATTERN,
        description=f"KV pool budget per pod: {SIZE_GRAMMAR} (what `kvfence serve "
        "--kv-cache-memory` reads).",
    )
    memory_fraction: float | None = Field(
        None, gt=0, le=1, description="KV pool budget as a fraction of free device memory."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=MAX_TENSOR_PARALLEL,
        description="Ranks each engine pod splits the model over (`kvfence serve "
        "--tensor-parallel-size`): as many GPUs per pod on CUDA, the default resources' "
        "nvidia.com/gpu; as many processes on CPU. Every rank runs the read check on its own "
        "part of each page.",
    )
    kv_checksum: bool = Field(True, description="Verify per-page checksums on KV transfer.")
    scrub_on_free: bool = Field(False, description="Zero KV pages when they are released.")
    prefix_cache: PrefixCacheSpec = Field(default_factory=PrefixCacheSpec, **OBJECT_DEFAULT)
    extra_args: list[ExtraArg] = Field(
        default_factory=list,
        max_length=64,
        description="More `kvfence serve` flags; not those the operator derives from the spec "
        "or sets itself (role, ports, context, pool budget, checksums, token), which it refuses.",
        json_schema_extra=cel(
            (
                f"self.all(a, !a.startsWith('{UNSAFE_FLAG_PREFIX}'))",
                "extraArgs must not contain --unsafe-fault (or an abbreviation of it): fault "
                "switches are for tests only",
            ),
            *(
                (
                    f"self.all(a, !a.matches('{spec_flag_pattern(flags)}'))",
                    spec_flag_message(flags, instead),
                )
                for flags, instead in SPEC_FLAGS
            ),
        ),
    )

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _a_size(cls, value: Any) -> Any:
        # before the pattern check, so the refusal says what the text could have meant
        if isinstance(value, str):
            parse_size(value)
        return value

    @model_validator(mode="after")
    def _one_budget_and_no_faults(self) -> "EngineSpec":
        if self.kv_cache_memory is not None and self.memory_fraction is not None:
            raise ValueError("set kvCacheMemory or memoryFraction, not both")
        unsafe = [a for a in self.extra_args if a.startswith(UNSAFE_FLAG_PREFIX)]
        if unsafe:
            raise ValueError(
                "extraArgs must not contain --unsafe-fault (or an abbreviation of it): fault "
                f"switches are for tests only; remove {unsafe}"
            )
        for flags, instead in SPEC_FLAGS:
            found = [a for a in self.extra_args if re.search(spec_flag_pattern(flags), a)]
            if found:
                raise ValueError(f"{spec_flag_message(flags, instead)}; remove {found}")
        return self


CUDA_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"  # a MIG slice: nvidia.com/mig-1g.10gb, ...
# Other vendors' device plugins: the engine image's torch is a CUDA build, so pods asking for
# these would hold the device and run on CPU (or fail to start); refused on apply instead.
OTHER_GPU_PREFIXES = ("amd.com/", "gpu.intel.com/")
OTHER_GPU_MESSAGE = (
    "resources: the engine image's torch runs on NVIDIA CUDA or on CPU only: request "
    f"{CUDA_RESOURCE} or a MIG slice ({MIG_RESOURCE_PREFIX}<profile>), not another vendor's GPU"
)
_OTHER_GPU_RULE = cel(
    (
        f"self.all(k, k == '{CUDA_RESOURCE}' || !(k.endsWith('/gpu')"
        + "".join(f" || k.startsWith('{prefix}')" for prefix in OTHER_GPU_PREFIXES)
        + "))",
        OTHER_GPU_MESSAGE,
    )
)


def is_cuda_resource(name: str) -> bool:
    return name == CUDA_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX)


def is_other_gpu_resource(name: str) -> bool:
    return name != CUDA_RESOURCE and (name.endswith("/gpu") or name.startswith(OTHER_GPU_PREFIXES))


class Resources(_ApiModel):
    """Container resources; replaces the default (one nvidia.com/gpu) as a whole. CPU and
    memory requests are added where these name neither (the pod is then Burstable)."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, max_length=32, json_schema_extra=_OTHER_GPU_RULE
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, max_length=32, json_schema_extra=_OTHER_GPU_RULE
    )

    @model_validator(mode="after")
    def _cuda_only(self) -> "Resources":
        other = sorted(n for n in [*self.requests, *self.limits] if is_other_gpu_resource(n))
        if other:
            raise ValueError(f"{OTHER_GPU_MESSAGE}; got {', '.join(other)}")
        return self


class EnvVar(_ApiModel):
    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256)
    value: str | None = None
    value_from: EnvVarSource | None = Field(
        None,
        description="A core/v1 EnvVarSource (a secretKeyRef may name any Secret in the "
        "namespace, as a pod's may).",
    )


class LocalObjectReference(_ApiModel):
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)


class PodOverrides(_ApiModel):
    """Scheduling and metadata for the role's pods (command, probes, security stay kvfence's)."""

    annotations: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra pod labels; kvfence's own labels win."
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    affinity: Affinity | None = None
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list, max_length=64
    )
    priority_class_name: str | None = Field(None, max_length=253)
    runtime_class_name: str | None = Field(None, max_length=253)
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment variables for the engine container.",
        json_schema_extra=cel(
            (
                f"self.all(e, e.name != '{UNSAFE_ENV}')",
                f"env must not set {UNSAFE_ENV}: fault switches are for tests only",
            )
        ),
    )

    @model_validator(mode="after")
    def _no_unsafe_env(self) -> "PodOverrides":
        if any(e.name == UNSAFE_ENV for e in self.env):
            raise ValueError(f"env must not set {UNSAFE_ENV}: fault switches are for tests only")
        return self


class EngineRoleSpec(_ApiModel):
    """The prefill or the decode half."""

    replicas: int = Field(1, ge=0)
    resources: Resources | None = Field(
        None, description="Default: requests and limits of one nvidia.com/gpu."
    )
    pod: PodOverrides = Field(default_factory=PodOverrides)


class RouterServiceSpec(_ApiModel):
    """The stable Service <name> that clients use."""

    type: ServiceType = ServiceType.CLUSTER_IP
    port: int = Field(8000, ge=1, le=65535)
    annotations: dict[str, str] = Field(default_factory=dict)


class RouterSpec(_ApiModel):
    replicas: int = Field(1, ge=0)
    api_keys_secret: str = Field(
        pattern=DNS_SUBDOMAIN_PATTERN,
        max_length=253,
        description="Secret in the same namespace whose key `api-keys` holds one "
        "'KEY TENANT' per line.",
    )
    service: RouterServiceSpec = Field(default_factory=RouterServiceSpec, **OBJECT_DEFAULT)
    pod: PodOverrides = Field(
        default_factory=PodOverrides,
        description="Scheduling and metadata for the router pods (imagePullSecrets for a private "
        "image); env goes to the router container. Part of the revision: a change rolls out.",
    )


class TenantLimits(_ApiModel):
    """Per-tenant limits, so that no tenant takes the queue or the KV pool from the others; a
    request over one gets 429 with Retry-After. Unset: no limit."""

    max_concurrent_requests: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Requests one tenant may have in flight at a router pod at once "
        "(kvfence router --max-concurrent-per-tenant).",
    )
    max_pool_share_per_tenant: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of each engine's KV pool one tenant's requests may reserve, each "
        "its prompt plus max_tokens (kvfence serve --max-pool-share-per-tenant).",
    )


class StandingLoad(_ApiModel):
    """The most a standing canary run adds to the serving revision's load."""

    max_requests: int = Field(
        400,
        ge=100,
        le=100_000,
        description="Requests one run may send; spent, the run stops without a verdict.",
    )
    requests_per_second: float = Field(
        2.0,
        gt=0,
        le=1000,
        description="Requests a second on average; one pollution burst (at most 32 requests) "
        "goes at once, or the run could not see a page lost to it.",
    )


class CanaryFailureAction(StrEnum):
    REPORT = "Report"  # say it (IsolationVerified, an Event, the metric) and serve on
    # also take the pods it implicates out of the routers (all of the revision's engine pods
    # when it names none): their kv-pool gate False, kept for inspection until deleted
    QUARANTINE = "Quarantine"


class CanarySpec(_ApiModel):
    """The isolation canary Job that gates every rollout, and the standing canary that keeps
    watching the serving revision."""

    enabled: bool = True
    timeout_seconds: int = Field(900, ge=1, le=86400)
    image: str | None = Field(
        None, pattern=r"^\S+$", max_length=1024, description="Default: the engine image."
    )
    pod: PodOverrides = Field(
        default_factory=PodOverrides,
        description="Scheduling and metadata for the canary Job's pods; env goes to the canary "
        "container. Applies to the next canary Job (no new revision).",
    )
    schedule: str | None = Field(
        None,
        max_length=128,
        pattern=SCHEDULE_PATTERN,
        description="Run the canary against the serving revision's stable Service on this "
        "schedule: a cron expression in UTC ('*/30 * * * *'), @hourly/@daily/..., or "
        "'@every 15m'. Off when unset. Runs never overlap; a failure sets IsolationVerified "
        "False. Applied in place: no new revision.",
    )
    standing_load: StandingLoad = Field(default_factory=StandingLoad, **OBJECT_DEFAULT)
    on_failure: CanaryFailureAction = Field(
        CanaryFailureAction.REPORT,
        description="What a failed standing run does beyond reporting it. Quarantine: the "
        "engine pods whose isolation counters rose in the run (every engine pod of the "
        "serving revision when the canary names none) leave the routers, their kv-pool gate "
        "False, until you delete them.",
    )

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str | None) -> str | None:
        if value is not None:
            parse_schedule(value)
        return value


class AutoscalingMode(StrEnum):
    OPERATOR = "Operator"  # the operator sets each role's replicas from its signal
    EXTERNAL = "External"  # a user's HPA or KEDA scales the child Deployments; drift leaves it


class ScalingSignal(StrEnum):
    """What a role scales on, and what its target is in."""

    QUEUED_PROMPT_TOKENS = "QueuedPromptTokens"  # prefill: prompt tokens waiting, per pod
    TIME_TO_FIRST_TOKEN = "TimeToFirstToken"  # prefill: p90 seconds over the last minute
    KV_POOL_UTILIZATION = "KvPoolUtilization"  # decode: fraction of the pool's pages in use
    RUNNING_SEQUENCES = "RunningSequences"  # decode: sequences decoding or waiting to, per pod
    INTER_TOKEN_LATENCY = "InterTokenLatency"  # decode: p90 seconds between tokens, last minute


PREFILL_SIGNALS = (ScalingSignal.QUEUED_PROMPT_TOKENS, ScalingSignal.TIME_TO_FIRST_TOKEN)
DECODE_SIGNALS = (
    ScalingSignal.KV_POOL_UTILIZATION,
    ScalingSignal.RUNNING_SEQUENCES,
    ScalingSignal.INTER_TOKEN_LATENCY,
)


# CEL sees the defaults the API server applies first; the emulated cluster does not default
_MIN_REPLICAS = "(has({0}.minReplicas) ? {0}.minReplicas : 1)"


class RoleAutoscaling(_ApiModel):
    """One role's bounds, signal and target, and how long a change must hold before it acts."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                f"{_MIN_REPLICAS.format('self')} <= self.maxReplicas",
                "minReplicas must be <= maxReplicas",
            ),
            (
                "self.signal != 'KvPoolUtilization' || double(self.target) <= 1.0",
                "a KvPoolUtilization target is a fraction of the pool, at most 1",
            ),
        )
    )

    min_replicas: int = Field(1, ge=1, le=1000)
    max_replicas: int = Field(ge=1, le=1000)
    signal: ScalingSignal
    target: float = Field(
        gt=0,
        description="The signal's value a pod should run at: tokens or sequences per pod, a "
        "fraction of the pool, or seconds (p90).",
    )
    scale_up_stabilization_seconds: int = Field(
        30,
        ge=0,
        le=3600,
        description="A scale-up acts on the lowest count asked for over this window.",
    )
    scale_down_stabilization_seconds: int = Field(
        300,
        ge=0,
        le=3600,
        description="A scale-down acts on the highest count asked for over this window.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> "RoleAutoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must be <= maxReplicas")
        if self.signal is ScalingSignal.KV_POOL_UTILIZATION and self.target > 1.0:
            raise ValueError("a KvPoolUtilization target is a fraction of the pool, at most 1")
        return self


class RatioGuard(_ApiModel):
    """Bounds on prefill replicas / decode replicas that every scaling decision keeps."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            ("double(self.min) <= double(self.max)", "the ratio's min must be <= its max")
        )
    )

    min: float = Field(gt=0, le=1000)
    max: float = Field(gt=0, le=1000)

    @model_validator(mode="after")
    def _ordered(self) -> "RatioGuard":
        if self.min > self.max:
            raise ValueError("the ratio's min must be <= its max")
        return self


def _role_signals(role: str, signals: tuple[ScalingSignal, ...]) -> tuple[str, str]:
    allowed = ", ".join(f"'{s}'" for s in signals)
    return (
        f"!has(self.{role}) || self.{role}.signal in [{allowed}]",
        f"{role} scales on {' or '.join(signals)}",
    )


RATIO_MEETS_BOUNDS = (
    "!has(self.prefillToDecodeRatio) || !has(self.prefill) || !has(self.decode) || "
    "(double(self.prefill.maxReplicas) >= double(self.prefillToDecodeRatio.min) * "
    f"double({_MIN_REPLICAS.format('self.decode')}) && "
    f"double({_MIN_REPLICAS.format('self.prefill')}) <= "
    "double(self.prefillToDecodeRatio.max) * double(self.decode.maxReplicas))"
)
RATIO_MESSAGE = "prefillToDecodeRatio admits no replica counts within the roles' bounds"
RATIO_NEEDS_ROLES = "prefillToDecodeRatio needs both prefill and decode autoscaling"


class AutoscalingSpec(_ApiModel):
    """Scaling prefill and decode replicas on their load (off when absent: the roles'
    replicas). Operator: the operator decides from the engines' load reports; External: a
    user's autoscaler owns the child Deployments' replicas."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            _role_signals("prefill", PREFILL_SIGNALS),
            _role_signals("decode", DECODE_SIGNALS),
            (
                "!has(self.prefillToDecodeRatio) || (has(self.prefill) && has(self.decode))",
                RATIO_NEEDS_ROLES,
            ),
            (RATIO_MEETS_BOUNDS, RATIO_MESSAGE),
        )
    )

    mode: AutoscalingMode = AutoscalingMode.OPERATOR
    prefill: RoleAutoscaling | None = None
    decode: RoleAutoscaling | None = None
    prefill_to_decode_ratio: RatioGuard | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "AutoscalingSpec":
        for role, scaling, signals in (
            ("prefill", self.prefill, PREFILL_SIGNALS),
            ("decode", self.decode, DECODE_SIGNALS),
        ):
            if scaling is not None and scaling.signal not in signals:
                raise ValueError(f"{role} scales on {' or '.join(signals)}")
        ratio, p, d = self.prefill_to_decode_ratio, self.prefill, self.decode
        if ratio is not None and (p is None or d is None):
            raise ValueError(RATIO_NEEDS_ROLES)
        if (
            ratio is not None
            and p is not None
            and d is not None
            and (
                p.max_replicas < ratio.min * d.min_replicas
                or p.min_replicas > ratio.max * d.max_replicas
            )
        ):
            raise ValueError(RATIO_MESSAGE)
        return self


PRE_STOP_SECONDS = 5  # a stopping pod's preStop sleep: time for endpoints to drop it


class RolloutSpec(_ApiModel):
    """How promotion hands traffic to the new revision without dropping any, and how a
    rollout is judged."""

    retire_after_seconds: int = Field(
        30,
        ge=0,
        le=86400,
        description="Seconds the old revision keeps running after the stable Service switched "
        "to the new one (clients' open connections finish there), before it is retired.",
    )
    termination_grace_period_seconds: int = Field(
        300,
        ge=PRE_STOP_SECONDS + 5,
        le=86400,
        description="The pods' terminationGracePeriodSeconds: make it longer than the longest "
        f"stream. A stopping pod leaves the Service endpoints for {PRE_STOP_SECONDS} s "
        "(preStop), then takes no new connection and lets requests in flight finish for the "
        "rest of it.",
    )
    progress_deadline_seconds: int = Field(
        600,
        ge=1,
        description="Seconds a rollout (or the serving revision's recovery) may go without "
        "progress before Stalled=True with reason ProgressDeadlineExceeded.",
    )


def _gpus_are_ranks(role: str) -> tuple[str, str]:
    """CEL: a role's GPUs per pod, where its resources name nvidia.com/gpu, are the ranks."""
    resources = f"self.{role}.resources"
    ranks = (
        "string(has(self.engine) && has(self.engine.tensorParallelSize) ? "
        "self.engine.tensorParallelSize : 1)"
    )
    # a count that is not a whole number is the quantity pattern's to refuse
    checks = " && ".join(
        f"(!has({resources}.{kind}) || !('{CUDA_RESOURCE}' in {resources}.{kind}) || "
        f"!string({resources}.{kind}['{CUDA_RESOURCE}']).matches('^[0-9]+$') || "
        f"string({resources}.{kind}['{CUDA_RESOURCE}']) == {ranks})"
        for kind in ("requests", "limits")
    )
    return (
        f"!has(self.{role}) || !has({resources}) || ({checks})",
        f"{role}.resources: {CUDA_RESOURCE} per pod must equal engine.tensorParallelSize (a "
        "rank per GPU)",
    )


class InferenceDeploymentSpec(_ApiModel):
    """What to serve, how big its context is, and how the pods run."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.minContextLength) || self.minContextLength <= self.contextLength",
                "minContextLength must be <= contextLength",
            ),
            _gpus_are_ranks("prefill"),
            _gpus_are_ranks("decode"),
        )
    )

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec, **OBJECT_DEFAULT)
    context_length: int = Field(gt=0, description="Tokens per request the deployment serves.")
    pool_policy: PoolPolicy = Field(
        PoolPolicy.REFUSE,
        description="Refuse: pods whose KV pool cannot hold contextLength never become Ready. "
        "LowerContext: serve the smallest pool's context, but not below minContextLength.",
    )
    min_context_length: int | None = Field(
        None, gt=0, description="Floor for LowerContext; below it pods are refused."
    )
    prefill: EngineRoleSpec = Field(default_factory=EngineRoleSpec, **OBJECT_DEFAULT)
    decode: EngineRoleSpec = Field(default_factory=EngineRoleSpec, **OBJECT_DEFAULT)
    router: RouterSpec
    tenant_limits: TenantLimits = Field(default_factory=TenantLimits)
    canary: CanarySpec = Field(default_factory=CanarySpec, **OBJECT_DEFAULT)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, **OBJECT_DEFAULT)
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Scale prefill and decode on their load (Operator), or leave their "
        "replicas to your HPA or KEDA (External). A role it scales ignores its replicas. "
        "Applied in place: no new revision.",
    )

    @model_validator(mode="after")
    def _min_context_fits(self) -> "InferenceDeploymentSpec":
        if self.min_context_length is not None and self.min_context_length > self.context_length:
            raise ValueError(
                f"minContextLength must be <= contextLength, got {self.min_context_length} > "
                f"{self.context_length}"
            )
        return self

    @model_validator(mode="after")
    def _a_gpu_per_rank(self) -> "InferenceDeploymentSpec":
        ranks = self.engine.tensor_parallel_size
        for role, spec in (("prefill", self.prefill), ("decode", self.decode)):
            resources = spec.resources
            if resources is None:
                continue
            for kind in (resources.requests, resources.limits):
                gpus = str(kind.get(CUDA_RESOURCE, ranks))
                if gpus.isdigit() and gpus != str(ranks):
                    raise ValueError(
                        f"{role}.resources: {CUDA_RESOURCE} per pod must equal "
                        f"engine.tensorParallelSize (a rank per GPU), got {gpus} and {ranks}"
                    )
        return self


# ---- status -----------------------------------------------------------------------------------


class _LenientModel(BaseModel):
    # Status and metadata are written by the operator and the API server, not by users:
    # tolerate fields this version does not model (a newer operator's, server-set metadata).
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    POOL_SUFFICIENT = "PoolSufficient"
    CANARY_PASSED = "CanaryPassed"
    # the standing canary's latest verdict on the serving revision (spec.canary.schedule)
    ISOLATION_VERIFIED = "IsolationVerified"
    # kstatus (Flux, kpt, cli-utils) reads these two abnormal-true conditions, not Ready:
    # they mirror Progressing and Degraded so GitOps tools judge health without extra config.
    RECONCILING = "Reconciling"
    STALLED = "Stalled"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionReason(StrEnum):
    """Every reason a condition carries: the InferenceDeployment's conditions and its engine
    pods' kvfence.dev/kv-pool readiness gate. An Event about the same finding carries the same
    reason."""

    # Ready
    SERVING = "Serving"
    ROLLOUT_IN_PROGRESS = "RolloutInProgress"
    SERVING_REVISION_UNREADY = "ServingRevisionUnready"
    SCALED_TO_ZERO = "ScaledToZero"
    # Progressing (Reconciling mirrors it)
    ROLLOUT_COMPLETE = "RolloutComplete"
    # the serving revision serves (its minimum available) while more of its pods start
    REPLICAS_STARTING = "ReplicasStarting"
    # Degraded (Stalled mirrors the terminal ones)
    AS_EXPECTED = "AsExpected"
    POOL_INSUFFICIENT = "PoolInsufficient"
    NAME_CONFLICT = "NameConflict"
    INVALID_SPEC = "InvalidSpec"
    CREDENTIALS_UNREADABLE = "CredentialsUnreadable"
    # the installed CRD lacks fields of this operator's (crd/installed.py): nothing reconciled
    CRD_OUTDATED = "CrdOutdated"
    CREATE_FAILED = "CreateFailed"  # the API refused to create a child (quota 403, webhook)
    CREATE_REJECTED = "CreateRejected"  # 422: the spec makes children the API server rejects
    API_KEYS_SECRET_MISSING = "ApiKeysSecretMissing"
    # an engine container exited with an error and has not been ready since (its own reason,
    # from its termination message)
    ENGINE_CRASH_LOOPING = "EngineCrashLooping"
    # a kept revision with no record of its spec that hashes to it (revision.recorded_spec)
    REVISION_RECORD_REFUSED = "RevisionRecordRefused"
    # Stalled
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    # CanaryPassed
    CANARY_PENDING = "CanaryPending"
    CANARY_PASSED = "CanaryPassed"
    CANARY_DISABLED = "CanaryDisabled"
    CANARY_NOT_RUN = "CanaryNotRun"
    CANARY_FAILED = "CanaryFailed"
    CANARY_COULD_NOT_RUN = "CanaryCouldNotRun"
    # IsolationVerified (with spec.canary.schedule); CanaryPassed too, until the first run
    STANDING_CANARY_PASSED = "StandingCanaryPassed"
    STANDING_CANARY_FAILED = "StandingCanaryFailed"
    STANDING_CANARY_COULD_NOT_RUN = "StandingCanaryCouldNotRun"
    # PoolSufficient, and a pod's kv-pool gate
    WAITING_FOR_PODS = "WaitingForPods"
    NO_ENGINE_PODS = "NoEnginePods"
    POOLS_HOLD_CONTEXT = "PoolsHoldContext"
    POOL_HOLDS_CONTEXT = "PoolHoldsContext"
    POOL_TOO_SMALL = "PoolTooSmall"
    POOL_UNKNOWN = "PoolUnknown"
    ISOLATION_DEFENCE_OFF = "IsolationDefenceOff"
    # a pod's kv-pool gate: a failed standing canary run implicated it (onFailure Quarantine)
    QUARANTINED = "Quarantined"


class EventReason(StrEnum):
    """The reasons of the Events that report a step of a rollout rather than a condition."""

    ROLLOUT_STARTED = "RolloutStarted"
    CANARY_STARTED = "CanaryStarted"
    CANARY_PASSED = "CanaryPassed"
    CANARY_RERUN = "CanaryRerun"
    PROMOTED = "Promoted"
    RETIRED = "Retired"
    # the stable Service's selector named a revision that does not serve: put back (drift)
    SELECTOR_REPAIRED = "SelectorRepaired"
    # a revision's spec record missing or not its own on one of its objects: put back
    RECORD_REPAIRED = "RecordRepaired"
    SCALED = "Scaled"  # the autoscaler changed a role's replicas (decisions/autoscaling.py)
    DRAINING = "Draining"  # pods a scale-down removes left the routers (decisions/draining.py)
    # a Deployment's replicas edited by someone else: put back to the declared count
    REPLICAS_REPAIRED = "ReplicasRepaired"
    # the standing canary (spec.canary.schedule): a run started, failed, could not run, or
    # passed again after one that did not
    STANDING_CANARY_STARTED = "StandingCanaryStarted"
    STANDING_CANARY_FAILED = "StandingCanaryFailed"
    STANDING_CANARY_COULD_NOT_RUN = "StandingCanaryCouldNotRun"
    STANDING_CANARY_PASSED = "StandingCanaryPassed"
    QUARANTINED = "Quarantined"  # pods a failed standing run implicated left the routers
    # the tenants the serving revision's routers answered in a failed run's exposure window
    EXPOSED_TENANTS = "ExposedTenants"


class Condition(_LenientModel):
    """metav1.Condition."""

    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    status: ConditionStatus
    reason: str = Field(
        min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
    )
    message: str = Field(max_length=32768)
    last_transition_time: datetime
    observed_generation: int | None = Field(None, ge=0)


class ContextLengthStatus(_LenientModel):
    requested: int | None = None
    effective: int | None = Field(None, description="Context the router serves now.")


class PoolReport(_LenientModel):
    """One engine pod's pool as its /v1/kvpool reported it."""

    pod: str
    role: Literal[Role.PREFILL, Role.DECODE]
    revision: str
    pool_tokens: int = Field(ge=0)


class RoleReplicas(_LenientModel):
    ready: int = 0
    desired: int = 0

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def summary(self) -> str:
        """ready/desired, for the printer columns."""
        return f"{self.ready}/{self.desired}"


class RetiringRevision(_LenientModel):
    revision: str
    since: datetime = Field(description="When the stable Service stopped selecting it.")


class RevisionStatus(_LenientModel):
    current: str | None = Field(None, description="Revision the stable Service points at.")
    candidate: str | None = Field(None, description="Revision being rolled out, if any.")
    retiring: list[RetiringRevision] | None = Field(
        None,
        description="Revisions no longer selected, draining until spec.rollout."
        "retireAfterSeconds has passed since then; then they are deleted.",
    )


class CanaryResult(StrEnum):
    PENDING = "Pending"  # will run once the pods are ready and their pools suffice
    RUNNING = "Running"
    PASSED = "Passed"
    FAILED = "Failed"
    NOT_RUN = "NotRun"  # will not run: disabled in the spec, or the pool check refused
    # no verdict: the canary could not run (exit 2, deadline, image) even after its retries
    COULD_NOT_RUN = "CouldNotRun"

    @classmethod
    def _missing_(cls, value: object) -> "CanaryResult | None":
        """Statuses written before NotRun said Skipped for a disabled canary."""
        return cls.NOT_RUN if value == "Skipped" else None


class CanaryStatus(_LenientModel):
    revision: str | None = None
    job: str | None = None
    job_uid: str | None = Field(
        None,
        description="UID of the Job the result was read from: a verdict is kept when that "
        "Job is gone, and another Job of the same name does not change it.",
    )
    rerun: str | None = Field(
        None, description="The kvfence.dev/rerun-canary value that Job was created with."
    )
    result: CanaryResult | None = None
    message: str | None = None


class StandingRun(_LenientModel):
    """One run of the standing canary."""

    job: str
    start_time: datetime
    result: CanaryResult = Field(description="Running, Passed, Failed or CouldNotRun.")
    message: str | None = Field(None, description="The canary's one-line summary.")


class StandingFailure(_LenientModel):
    """The last run that failed, and since when the revision may have mixed tenants."""

    job: str
    time: datetime = Field(description="When the operator read the failing verdict.")
    message: str
    exposure_since: datetime | None = Field(
        None,
        description="The start of the last run that passed before it (the rollout's canary "
        "Job when none had): isolation held then; from then to `time` it may not have.",
    )
    tenants: dict[str, int] | None = Field(
        None,
        description="Requests the revision's routers answered per tenant in the window (in "
        "whole minutes; the canary's own tenants left out): whom to tell.",
    )
    tenants_read: str | None = Field(
        None, description="How much of the window the routers could account for."
    )


class StandingCanaryStatus(_LenientModel):
    """The standing canary's watch over the serving revision (spec.canary.schedule)."""

    revision: str = Field(description="The serving revision it watches.")
    schedule: str
    next_run_time: datetime | None = None
    last_run: StandingRun | None = None
    last_passed_job: str | None = Field(None, description="The last run that passed.")
    last_passed_time: datetime | None = Field(
        None,
        description="The start of the last run that passed; before one has, of the rollout "
        "canary's Job (else when the watch began).",
    )
    last_failure: StandingFailure | None = None
    quarantined: list[str] | None = Field(
        None,
        description="Engine pods out of the routers after a failed run (spec.canary.onFailure "
        "Quarantine), until they are deleted.",
    )


class CandidateStatus(_LenientModel):
    """The revision being rolled out, beside the serving one's numbers (`kubectl get -o wide`)."""

    revision: str | None = None
    prefill: RoleReplicas | None = None
    decode: RoleReplicas | None = None
    router: RoleReplicas | None = None
    context_length: int | None = Field(None, description="Context its pools would serve.")
    min_pool_tokens: int | None = Field(None, description="Smallest pool of its engine pods.")


class ProgressStatus(_LenientModel):
    """When the rollout (or the serving revision's recovery) last moved, and what it was
    waiting for then: Stalled=True once it has not moved for progressDeadlineSeconds."""

    mark: str
    last_progress_time: datetime


class RoleScalingStatus(_LenientModel):
    """One role's autoscaling: the replicas its Deployment runs, the count decided, and why."""

    current: int = Field(0, description="Replicas the serving revision's Deployment runs.")
    desired: int | None = Field(None, description="Replicas the autoscaler decided (Operator).")
    signal: ScalingSignal | None = None
    value: float | None = Field(None, description="The signal's value, per pod or the pods'.")
    target: float | None = None
    bound: str | None = Field(None, description="What beyond the signal set the count.")
    draining: list[str] | None = Field(
        None, description="Pods out of the routers, finishing their streams before removal."
    )
    last_scale_time: datetime | None = None

    @computed_field  # type: ignore[prop-decorator]  # mypy rejects decorators over @property
    @property
    def summary(self) -> str:
        """current/desired, for the printer columns (External: current alone)."""
        return f"{self.current}/{self.desired}" if self.desired is not None else str(self.current)


class AutoscalingStatus(_LenientModel):
    mode: AutoscalingMode
    prefill: RoleScalingStatus | None = None
    decode: RoleScalingStatus | None = None


class InferenceDeploymentStatus(_LenientModel):
    """What the operator observed; rollout state lives here so a restart resumes."""

    observed_generation: int | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    context_length: ContextLengthStatus | None = None
    pools: list[PoolReport] = Field(default_factory=list)
    min_pool_tokens: int | None = Field(None, description="Smallest pool over all engine pods.")
    prefill: RoleReplicas | None = None
    decode: RoleReplicas | None = None
    router: RoleReplicas | None = None
    revision: RevisionStatus | None = None
    canary: CanaryStatus | None = None
    endpoint: str | None = Field(None, description="URL of the stable Service.")
    candidate: CandidateStatus | None = None
    progress: ProgressStatus | None = None
    autoscaling: AutoscalingStatus | None = None
    standing_canary: StandingCanaryStatus | None = None


class ObjectMeta(_LenientModel):
    """The part of metav1.ObjectMeta the operator reads."""

    name: str = Field(max_length=NAME_MAX_LENGTH, pattern=NAME_PATTERN)
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferenceDeployment(_ApiModel):
    """A whole manifest, as `kubectl apply` or `kvfence up` takes it."""

    api_version: Literal["kvfence.dev/v1alpha1"]
    kind: Literal["InferenceDeployment"]
    metadata: ObjectMeta
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus | None = None
