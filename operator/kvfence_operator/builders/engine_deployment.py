"""Prefill and decode: their `kvfence serve` command line, Deployments and headless Services."""

from typing import Any

from kvfence_operator.builders.metrics import NO_METRICS_ACCESS, MetricsAccess
from kvfence_operator.builders.pod_template import (
    INTERNAL_TOKEN_FILE,
    TERMINATION_LOG,
    container_security_context,
    cpu_threads,
    drain_seconds,
    engine_resources,
    home_in_tmp,
    http_port,
    http_probes,
    model_volume,
    no_weights_cache,
    override_env,
    pod_template,
    pre_stop,
    tmp_volume,
)
from kvfence_operator.builders.resources import engine_device, with_default_requests
from kvfence_operator.builders.secret import (
    PREFIX_CACHE_SECRET_FILE,
    internal_token_volume,
    prefix_cache_secret_item,
)
from kvfence_operator.crd.types import InferenceDeploymentSpec, KvCacheDtype, PoolPolicy, Role
from kvfence_operator.meta import (
    HTTP_PORT,
    KV_POOL_GATE,
    TRANSFER_PORT,
    Instance,
    child_name,
    labels,
    object_meta,
    selector,
)

ENGINE_ROLES = (Role.PREFILL, Role.DECODE)
CONTEXT_POLICY_FLAG = {PoolPolicy.REFUSE: "refuse", PoolPolicy.LOWER_CONTEXT: "lower"}


def _check_role(role: Role) -> None:
    if role not in ENGINE_ROLES:
        raise ValueError(f"engine role must be prefill or decode, got {role!r}")


def engine_args(
    spec: InferenceDeploymentSpec,
    role: Role,
    revision: str,
    device: str,
    metrics: MetricsAccess = NO_METRICS_ACCESS,
) -> list[str]:
    """`kvfence serve` arguments. extraArgs come first so that the operator's flags, which the
    pool check and the isolation defences depend on, win (argparse keeps the last value)."""
    _check_role(role)
    engine = spec.engine
    role_spec = spec.prefill if role is Role.PREFILL else spec.decode
    ranks = engine.tensor_parallel_size
    threads = cpu_threads(engine_resources(role_spec.resources, ranks))
    if threads is not None:
        threads = max(1, threads // ranks)  # --threads is each rank's
    args = [
        "serve",
        # the pod's CPUs, before extraArgs so that a --threads there wins
        *(["--threads", str(threads)] if threads is not None else []),
        *engine.extra_args,
        "--role", str(role),
        "--model", spec.model.source,
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--transfer-port", str(TRANSFER_PORT),
        "--context-length", str(spec.context_length),
        "--context-policy", CONTEXT_POLICY_FLAG[spec.pool_policy],
        "--drain-seconds", str(drain_seconds(spec.rollout)),
    ]  # fmt: skip
    if engine.kv_cache_memory is not None:
        args += ["--kv-cache-memory", engine.kv_cache_memory]
    elif engine.memory_fraction is not None:
        args += ["--memory-fraction", str(engine.memory_fraction)]
    args += [
        "--page-size", str(engine.page_size),
        "--revision", revision,
        "--device", device,
        "--internal-token-file", INTERNAL_TOKEN_FILE,
        "--termination-log", TERMINATION_LOG,
        *metrics.args(),
    ]  # fmt: skip
    # Non-default settings only, so a default spec needs no flag beyond the ones above.
    if engine.kv_cache_dtype is not KvCacheDtype.AUTO:
        args += ["--kv-cache-dtype", str(engine.kv_cache_dtype)]
    if ranks > 1:
        args += ["--tensor-parallel-size", str(ranks)]
    if not engine.kv_checksum:
        args.append("--no-kv-checksum")
    if engine.scrub_on_free:
        args.append("--scrub-on-free")
    share = spec.tenant_limits.max_pool_share_per_tenant
    if share is not None:
        args += ["--max-pool-share-per-tenant", str(share)]
    if caches_prefixes(spec, role):
        args += ["--prefix-cache", "--prefix-cache-secret-file", PREFIX_CACHE_SECRET_FILE]
        cache = spec.engine.prefix_cache
        for flag, value in (
            ("--prefix-cache-share", cache.share),
            ("--prefix-cache-tenants", cache.tenants),
            ("--prefix-cache-idle-seconds", cache.idle_seconds),
        ):
            if value is not None:
                args += [flag, str(value)]
    return args


def caches_prefixes(spec: InferenceDeploymentSpec, role: Role) -> bool:
    """Whether this role's engines run the prefix cache: prefill, with prefixCache on (decode
    receives a prompt's KV whole and computes none of it)."""
    return spec.engine.prefix_cache.enabled and role is Role.PREFILL


def build_engine_deployment(
    spec: InferenceDeploymentSpec,
    instance: Instance,
    revision: str,
    role: Role,
    metrics: MetricsAccess = NO_METRICS_ACCESS,
) -> dict[str, Any]:
    """Engine pods stay out of Service endpoints until the operator has read their real pool
    size and set the kvfence.dev/kv-pool readiness gate."""
    _check_role(role)
    role_spec = spec.prefill if role is Role.PREFILL else spec.decode
    resources = engine_resources(role_spec.resources, spec.engine.tensor_parallel_size)
    device = engine_device(resources)
    ports = [http_port()]
    if role is Role.DECODE:  # decode receives KV from prefill here
        ports.append({"name": "transfer", "containerPort": TRANSFER_PORT, "protocol": "TCP"})
    tmp, tmp_mount = tmp_volume()
    token, token_mount = internal_token_volume(instance, revision)
    if caches_prefixes(spec, role):
        token["secret"]["items"].append(prefix_cache_secret_item())
    models = model_volume(spec.model)
    container = {
        "name": "engine",
        "image": spec.engine.image,
        "command": ["kvfence"],
        "args": engine_args(spec, role, revision, device, metrics),
        "ports": ports,
        "env": [home_in_tmp(), no_weights_cache(), *override_env(role_spec.pod)],
        "resources": with_default_requests(resources),
        "securityContext": container_security_context(),
        "volumeMounts": [tmp_mount, token_mount, *(mount for _, mount in models)],
        **http_probes(),
        **pre_stop(),
        # An engine that cannot load its model exits with the reason in TERMINATION_LOG (a
        # crash loop whose message says why); any other crash falls back to the log's tail.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    template = pod_template(
        pod_labels=labels(instance, revision, role),
        containers=[container],
        volumes=[tmp, token, *(volume for volume, _ in models)],
        overrides=role_spec.pod,
        readiness_gates=[KV_POOL_GATE],
        termination_grace_period_seconds=spec.rollout.termination_grace_period_seconds,
    )
    name = child_name(instance, revision, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(instance, name, labels(instance, revision, role)),
        "spec": {
            "replicas": role_spec.replicas,
            "selector": {"matchLabels": selector(instance, revision, role)},
            "template": template,
        },
    }


def build_engine_service(instance: Instance, revision: str, role: Role) -> dict[str, Any]:
    """Headless: the router resolves it to the Ready (pool-checked) pods of one revision."""
    _check_role(role)
    ports = [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]
    if role is Role.DECODE:
        ports.append(
            {"name": "transfer", "port": TRANSFER_PORT, "targetPort": "transfer", "protocol": "TCP"}
        )
    name = child_name(instance, revision, role)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(instance, name, labels(instance, revision, role)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector(instance, revision, role),
            "ports": ports,
        },
    }
