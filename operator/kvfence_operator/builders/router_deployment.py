"""The router: its backends file (ConfigMap), Deployment, per-revision Service (the canary's
target) and the stable Service <name> that clients use."""

from collections.abc import Sequence
from typing import Any

from kvfence_engine.contracts import BackendsFile, ServedModel
from kvfence_operator.builders.metrics import NO_METRICS_ACCESS, MetricsAccess
from kvfence_operator.builders.pod_template import (
    CREDENTIALS_DIR,
    INTERNAL_TOKEN_FILE,
    container_security_context,
    drain_seconds,
    home_in_tmp,
    http_port,
    http_probes,
    override_env,
    pod_template,
    pre_stop,
    tmp_volume,
)
from kvfence_operator.builders.secret import (
    CANARY_API_KEYS_KEY,
    CREDENTIALS_MARK,
    INTERNAL_TOKEN_KEY,
    ROUTING_SECRET_FILE,
    USER_API_KEYS_KEY,
    routing_secret_item,
    secret_name,
)
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import (
    ANNOTATION_SERVING,
    ANNOTATION_SPEC,
    HTTP_PORT,
    MANAGED_ANNOTATIONS,
    Instance,
    child_name,
    labels,
    object_meta,
    selector,
)
from kvfence_operator.revision import spec_record

CONFIG_DIR = "/etc/kvfence"
BACKENDS_FILE_NAME = "backends.json"
BACKENDS_FILE = f"{CONFIG_DIR}/{BACKENDS_FILE_NAME}"
TENANT_KEYS_FILE = f"{CREDENTIALS_DIR}/api-keys/tenants"
CANARY_KEYS_FILE = f"{CREDENTIALS_DIR}/api-keys/canary"
ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}}


def router_backends(
    spec: InferenceDeploymentSpec,
    revision: str,
    context_length: int | None = None,
    prefill_urls: Sequence[str] = (),
    decode_urls: Sequence[str] = (),
    version: int = 0,
) -> BackendsFile:
    """The router's live configuration, which the operator rewrites as pods come and go: the
    engine pods whose pool check passed (their kvfence.dev/kv-pool gate is True), by URL, and
    the served context (under LowerContext, lowered to what every pool holds). A headless
    Service would resolve to the same Ready pods, but only after DNS caches expire, and not at
    all in `kvfence up`; the operator knows first."""
    return BackendsFile(
        version=version,
        revision=revision,
        model=ServedModel(source=spec.model.source, name=spec.model.name),
        context_length=spec.context_length if context_length is None else context_length,
        prefill=sorted(prefill_urls),
        decode=sorted(decode_urls),
    )


def build_router_configmap(
    spec: InferenceDeploymentSpec,
    instance: Instance,
    revision: str,
    context_length: int | None = None,
    prefill_urls: Sequence[str] = (),
    decode_urls: Sequence[str] = (),
    version: int = 0,
    *,
    mark: str | None = None,
) -> dict[str, Any]:
    """The backends file, and the spec it was computed from (`spec`: the revision's own, see
    revision.judged_spec), recorded for the passes to come. `version`: see router_push.
    `mark`: the key that derived the revision's credentials (secret.CREDENTIALS_MARK)."""
    backends = router_backends(spec, revision, context_length, prefill_urls, decode_urls, version)
    name = child_name(instance, revision, Role.ROUTER)
    metadata = object_meta(instance, name, labels(instance, revision, Role.ROUTER))
    metadata["annotations"] = {ANNOTATION_SPEC: spec_record(spec)}
    if mark is not None:
        metadata["annotations"][CREDENTIALS_MARK] = mark
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {BACKENDS_FILE_NAME: backends.file_text()},
    }


def router_args(
    spec: InferenceDeploymentSpec, metrics: MetricsAccess = NO_METRICS_ACCESS
) -> list[str]:
    concurrent = spec.tenant_limits.max_concurrent_requests
    limits = ["--max-concurrent-per-tenant", str(concurrent)] if concurrent else []
    # with the prefill engines' prefix cache: a tenant's alike prompts to the same instance
    routing = (
        ["--routing-secret-file", ROUTING_SECRET_FILE] if spec.engine.prefix_cache.enabled else []
    )
    return [
        "router",
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--backends-file", BACKENDS_FILE,
        # Its tokenizer: the router rejects over-long prompts. A model on a volume: the
        # router mounts nothing and reads the engines' own tokenizer from them.
        *(
            ["--tokenizer-from-engines"]
            if spec.model.volume is not None
            else ["--model", spec.model.source]
        ),
        "--api-keys", TENANT_KEYS_FILE,
        "--api-keys", CANARY_KEYS_FILE,
        # No --context-length: it would override the backends file, where the operator
        # writes the served (possibly lowered) context.
        "--internal-token-file", INTERNAL_TOKEN_FILE,
        "--drain-seconds", str(drain_seconds(spec.rollout)),
        *limits,
        *routing,
        *metrics.args(),
    ]  # fmt: skip


def build_router_deployment(
    spec: InferenceDeploymentSpec,
    instance: Instance,
    revision: str,
    metrics: MetricsAccess = NO_METRICS_ACCESS,
) -> dict[str, Any]:
    name = child_name(instance, revision, Role.ROUTER)
    tmp, tmp_mount = tmp_volume()
    config = {"name": "config", "configMap": {"name": name}}
    revision_items = [
        {"key": INTERNAL_TOKEN_KEY, "path": "internal-token"},
        {"key": CANARY_API_KEYS_KEY, "path": "api-keys/canary"},
    ]
    if spec.engine.prefix_cache.enabled:
        revision_items.append(routing_secret_item())
    # One read-only directory: the token, the users' keys and this revision's canary keys.
    credentials = {
        "name": "credentials",
        "projected": {
            "defaultMode": 0o440,
            "sources": [
                {
                    "secret": {
                        "name": secret_name(instance, revision),
                        "items": revision_items,
                    }
                },
                {
                    "secret": {
                        "name": spec.router.api_keys_secret,
                        "items": [{"key": USER_API_KEYS_KEY, "path": "api-keys/tenants"}],
                    }
                },
            ],
        },
    }
    container = {
        "name": "router",
        "image": spec.engine.image,
        "command": ["kvfence"],
        "args": router_args(spec, metrics),
        "ports": [http_port()],
        "env": [home_in_tmp(), *override_env(spec.router.pod)],
        "resources": {k: dict(v) for k, v in ROUTER_RESOURCES.items()},
        "securityContext": container_security_context(),
        "volumeMounts": [
            tmp_mount,
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True},
        ],
        **http_probes(),
        **pre_stop(),
    }
    template = pod_template(
        pod_labels=labels(instance, revision, Role.ROUTER),
        containers=[container],
        volumes=[tmp, config, credentials],
        overrides=spec.router.pod,
        termination_grace_period_seconds=spec.rollout.termination_grace_period_seconds,
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(instance, name, labels(instance, revision, Role.ROUTER)),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector(instance, revision, Role.ROUTER)},
            "template": template,
        },
    }


def build_router_service(instance: Instance, revision: str) -> dict[str, Any]:
    """One revision's routers, reachable before promotion: the canary Job targets this."""
    name = child_name(instance, revision, Role.ROUTER)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(instance, name, labels(instance, revision, Role.ROUTER)),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(instance, revision, Role.ROUTER),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_stable_service(
    spec: InferenceDeploymentSpec, instance: Instance, revision: str, seal: str | None = None
) -> dict[str, Any]:
    """The Service <name> clients use; promotion is switching its selector to a new revision.
    Its annotations are spec.router.service.annotations plus the list of their keys (so that
    a key dropped from the spec can be removed, and only such a key), and `seal`
    (secret.serving_seal: the operator's mark of the revision it serves) when there is one."""
    service = spec.router.service
    metadata = object_meta(instance, instance.name, labels(instance))
    metadata["annotations"] = {
        **service.annotations,
        MANAGED_ANNOTATIONS: ",".join(sorted(service.annotations)),
        **({ANNOTATION_SERVING: seal} if seal is not None else {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": str(service.type),
            "selector": selector(instance, revision, Role.ROUTER),
            "ports": [
                {"name": "http", "port": service.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
