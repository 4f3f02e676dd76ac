"""The canary Job: tenant B tries to see tenant A's secret through a candidate revision's router.
Promotion waits for it to succeed."""

from typing import Any

from kvfence_operator.builders.pod_template import (
    INTERNAL_TOKEN_FILE,
    container_security_context,
    home_in_tmp,
    override_env,
    pod_template,
    tmp_volume,
)
from kvfence_operator.builders.secret import (
    CANARY_TENANT_A_KEY,
    CANARY_TENANT_B_KEY,
    internal_token_volume,
    secret_name,
)
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.meta import (
    ANNOTATION_RERUN_CANARY,
    Instance,
    child_name,
    labels,
    object_meta,
    service_url,
)

TENANT_A_ENV = "KVFENCE_CANARY_TENANT_A_KEY"
TENANT_B_ENV = "KVFENCE_CANARY_TENANT_B_KEY"
TERMINATION_LOG = "/dev/termination-log"  # the operator reads the verdict from the pod status
# Past the canary's own --timeout, so the canary reports its timeout before the Job is killed.
DEADLINE_GRACE_SECONDS = 60
CANARY_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}}
CONTAINER = "canary"
# `kvfence canary` exits 1 for a finding, 2 when it could not run (kvfence_engine/canary/report.py)
EXIT_FINDING = 1
# Tries after the first one for a canary that could not run (exit 2, any exit but 1, a pod
# that failed to start); all of them within activeDeadlineSeconds.
RETRIES = 3
STANDING = "watch"  # a standing canary Job is <name>-<revision>-watch<start, base 36>


def pod_failure_policy() -> dict[str, Any]:
    """A finding fails the Job at once: it is not a flake to retry away. A pod disrupted by
    the cluster (eviction, preemption, a drained node) is not counted. Anything else counts
    towards backoffLimit and is retried after the Job's backoff."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER,
                    "operator": "In",
                    "values": [EXIT_FINDING],
                },
            },
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
        ]
    }


def canary_job_name(instance: Instance, revision: str) -> str:
    return child_name(instance, revision, Role.CANARY)


def canary_args(
    spec: InferenceDeploymentSpec, instance: Instance, revision: str, context_length: int
) -> list[str]:
    """The rollout's canary: against the candidate's own router Service."""
    target = service_url(instance, child_name(instance, revision, Role.ROUTER))
    return _args(spec, target, context_length)


def standing_args(
    spec: InferenceDeploymentSpec, instance: Instance, context_length: int
) -> list[str]:
    """The standing canary: against the stable Service, what clients reach, one round, within
    spec.canary.standingLoad."""
    target = service_url(instance, instance.name, spec.router.service.port)
    load = spec.canary.standing_load
    return [
        *_args(spec, target, context_length),
        "--rounds", "1",
        "--max-requests", str(load.max_requests),
        "--rate", f"{load.requests_per_second:g}",
    ]  # fmt: skip


def _args(spec: InferenceDeploymentSpec, target: str, context_length: int) -> list[str]:
    return [
        "canary",
        "--target", target,
        # $(VAR) is expanded by the kubelet, so the keys never appear in the Job's spec. The
        # = form matters: a generated key may start with "-", which argparse would otherwise
        # take for an option.
        f"--tenant-a-key=$({TENANT_A_ENV})",
        f"--tenant-b-key=$({TENANT_B_ENV})",
        # only for the router's /metrics (the engines' isolation counters), not for tenants
        "--internal-token-file", INTERNAL_TOKEN_FILE,
        "--context-length", str(context_length),
        "--termination-log", TERMINATION_LOG,
        "--timeout", str(spec.canary.timeout_seconds),
    ]  # fmt: skip


def build_canary_job(
    spec: InferenceDeploymentSpec,
    instance: Instance,
    revision: str,
    context_length: int | None = None,
    rerun: str = "",
) -> dict[str, Any]:
    """context_length: the context the revision serves (effective, under LowerContext).
    rerun: the InferenceDeployment's kvfence.dev/rerun-canary value, recorded on the Job
    (decisions/canary.py)."""
    context = spec.context_length if context_length is None else context_length
    args = canary_args(spec, instance, revision, context)
    annotations = {ANNOTATION_RERUN_CANARY: rerun} if rerun else {}
    return _job(spec, instance, revision, canary_job_name(instance, revision), args, annotations)


def standing_job_prefix(instance: Instance, revision: str) -> str:
    return child_name(instance, revision, STANDING)


def standing_job_name(instance: Instance, revision: str, started: int) -> str:
    """One name per run: the prefix and the run's start (unix seconds, base 36), within the
    11 characters a component has (meta.NAME_MAX_LENGTH)."""
    return standing_job_prefix(instance, revision) + _base36(started)


def build_standing_job(
    spec: InferenceDeploymentSpec, instance: Instance, revision: str, context_length: int, name: str
) -> dict[str, Any]:
    """A standing canary run against the serving revision (decisions/standing_canary.py)."""
    args = standing_args(spec, instance, context_length)
    return _job(spec, instance, revision, name, args, {})


def _job(
    spec: InferenceDeploymentSpec,
    instance: Instance,
    revision: str,
    name: str,
    args: list[str],
    annotations: dict[str, str],
) -> dict[str, Any]:
    secret = secret_name(instance, revision)
    tmp, tmp_mount = tmp_volume()
    token, token_mount = internal_token_volume(instance, revision)
    container = {
        "name": CONTAINER,
        "image": spec.canary.image or spec.engine.image,
        "command": ["kvfence"],
        "args": args,
        "env": [
            home_in_tmp(),
            *override_env(spec.canary.pod),  # before the keys: the last of a name wins
            *(
                {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
                for env, key in (
                    (TENANT_A_ENV, CANARY_TENANT_A_KEY),
                    (TENANT_B_ENV, CANARY_TENANT_B_KEY),
                )
            ),
        ],
        "resources": {k: dict(v) for k, v in CANARY_RESOURCES.items()},
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "File",
        "volumeMounts": [tmp_mount, token_mount],
    }
    template = pod_template(
        pod_labels=labels(instance, revision, Role.CANARY),
        containers=[container],
        volumes=[tmp, token],
        restart_policy="Never",
        overrides=spec.canary.pod,
    )
    meta = object_meta(instance, name, labels(instance, revision, Role.CANARY))
    if annotations:
        meta["annotations"] = annotations
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": RETRIES,
            "podFailurePolicy": pod_failure_policy(),
            "activeDeadlineSeconds": spec.canary.timeout_seconds + DEADLINE_GRACE_SECONDS,
            "template": template,
        },
    }


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, rest = divmod(number, 36)
        out = digits[rest] + out
        if number == 0:
            return out
