"""The Deployment and Job controllers, reduced to what kvfence uses.

Level-based: each pass looks at every Deployment and Job and closes the gap to its pods.
Deployments own their pods directly (no ReplicaSets); a template change replaces all pods at
once, as with `strategy: Recreate`. Jobs run one pod at a time, with backoffLimit (and a short
exponential backoff between pods), podFailurePolicy (FailJob, Ignore, Count on exit codes and
pod conditions) and activeDeadlineSeconds, and report conditions as the real Job controller
(1.31+) does.
"""

import contextlib
import hashlib
import json
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .resources import ApiError, ResourceType, now_rfc3339, random_suffix
from .selectors import selector_from_label_selector
from .store import Store

POD_TEMPLATE_HASH = "pod-template-hash"
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
# A Job's pod after a counted failure starts again after 1, 2, 4, 8 s (Kubernetes: 10 s to 6 min)
JOB_BACKOFF_SECONDS = 1.0
JOB_BACKOFF_MAX_SECONDS = 8.0


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next(
        (c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind),
        None,
    )


def pod_ready(pod: dict[str, Any]) -> bool:
    ready = condition(pod, "Ready")
    return ready is not None and ready.get("status") == "True"


def deletion_cost(pod: dict[str, Any]) -> int:
    """The pod's POD_DELETION_COST, read as Kubernetes reads it: an int32 in decimal, no "+" nor
    leading zero; 0 when absent or invalid."""
    value = (pod["metadata"].get("annotations") or {}).get(POD_DELETION_COST)
    if not isinstance(value, str) or not re.fullmatch(r"0|[1-9][0-9]*|-[0-9]+", value):
        return 0
    cost = int(value)
    return cost if -(2**31) <= cost < 2**31 else 0


def set_condition(
    conditions: list[dict[str, Any]],
    kind: str,
    status: str,
    reason: str | None = None,
    message: str | None = None,
    **extra: Any,
) -> list[dict[str, Any]]:
    """Replace one condition; lastTransitionTime moves only when the status flips. A reason or
    message of None is left out (the kubelet writes none on True pod conditions)."""
    old = next((c for c in conditions if c.get("type") == kind), None)
    wanted = (status, reason, message)
    if old is not None and (old.get("status"), old.get("reason"), old.get("message")) == wanted:
        return conditions
    changed = old is None or old.get("status") != status
    new: dict[str, Any] = {"type": kind, "status": status}
    new.update({k: v for k, v in (("reason", reason), ("message", message)) if v is not None})
    new.update(extra)
    new["lastTransitionTime"] = (
        old["lastTransitionTime"] if old is not None and not changed else now_rfc3339()
    )
    return [new if c is old else c for c in conditions] if old is not None else [*conditions, new]


def template_hash(template: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    return "".join(NAME_ALPHABET[b % len(NAME_ALPHABET)] for b in digest[:10])


def _owner(owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pod_from_template(
    owner: dict[str, Any], name: str, extra_labels: dict[str, str]
) -> dict[str, Any]:
    template = owner["spec"]["template"]
    meta = template.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": owner["metadata"]["namespace"],
            "labels": {**(meta.get("labels") or {}), **extra_labels},
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [_owner(owner)],
        },
        "spec": json.loads(json.dumps(template.get("spec") or {})),
    }


class Controllers:
    def __init__(
        self, store: Store, resource_type: Callable[[str, str, str], ResourceType]
    ) -> None:
        self.store = store
        self.pods = resource_type("", "v1", "pods")
        self.deployments = resource_type("apps", "v1", "deployments")
        self.jobs = resource_type("batch", "v1", "jobs")

    def reconcile(self) -> None:
        pods_by_owner: dict[str, list[dict[str, Any]]] = {}
        for pod in self.store.list_objects(self.pods):
            if (uid := controller_uid(pod)) is not None:
                pods_by_owner.setdefault(uid, []).append(pod)
        for deployment in self.store.list_objects(self.deployments):
            if not deployment["metadata"].get("deletionTimestamp"):
                self._deployment(deployment, pods_by_owner.get(deployment["metadata"]["uid"], []))
        for job in self.store.list_objects(self.jobs):
            if not job["metadata"].get("deletionTimestamp"):
                self._job(job, pods_by_owner.get(job["metadata"]["uid"], []))

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):  # already gone
            self.store.delete(self.pods, pod["metadata"]["namespace"], pod["metadata"]["name"])

    # ---- Deployments ----------------------------------------------------------------------

    def _deployment(self, deployment: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        meta, spec = deployment["metadata"], deployment["spec"]
        wanted = int(spec.get("replicas", 1))
        current_hash = template_hash(spec["template"])
        selector = selector_from_label_selector(spec.get("selector"))
        # A finished pod (an evicted one: phase Failed) is no replica: the ReplicaSet controller
        # replaces it and leaves it to pod GC.
        live = [
            p
            for p in pods
            if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        current = []
        for pod in live:
            labels = pod["metadata"].get("labels") or {}
            if labels.get(POD_TEMPLATE_HASH) == current_hash and all(
                r.matches(labels) for r in selector
            ):
                current.append(pod)
            else:
                self._delete_pod(pod)
        # Surplus, ranked as the ReplicaSet controller ranks it (ActivePodsWithRanks): not-ready
        # pods first, then the lowest pod-deletion cost, then the newest. Keepers sort first.
        current.sort(key=lambda p: (pod_ready(p), deletion_cost(p), -_created(p)), reverse=True)
        for pod in current[wanted:]:
            self._delete_pod(pod)
        current = current[:wanted]
        for _ in range(wanted - len(current)):
            name = f"{meta['name']}-{current_hash}-{random_suffix()}"
            pod = pod_from_template(deployment, name, {POD_TEMPLATE_HASH: current_hash})
            current.append(self.store.create(self.pods, meta["namespace"], pod))
        ready = sum(pod_ready(p) for p in current)
        status: dict[str, Any] = {"observedGeneration": meta.get("generation", 1)}
        counts = {
            "replicas": len(current),
            "updatedReplicas": len(current),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(wanted - ready, 0),
        }
        status.update({k: v for k, v in counts.items() if v})  # zero counts are omitted
        conditions = (deployment.get("status") or {}).get("conditions") or []
        available = ready >= wanted
        conditions = set_condition(
            conditions,
            "Available",
            "True" if available else "False",
            "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
            "Deployment has minimum availability."
            if available
            else "Deployment does not have minimum availability.",
            lastUpdateTime=now_rfc3339(),
        )
        conditions = set_condition(
            conditions,
            "Progressing",
            "True",
            "NewReplicaSetAvailable" if available else "ReplicaSetUpdated",
            f'ReplicaSet "{meta["name"]}-{current_hash}" '
            + ("has successfully progressed." if available else "is progressing."),
            lastUpdateTime=now_rfc3339(),
        )
        status["conditions"] = conditions
        self.store.update(
            self.deployments,
            meta["namespace"],
            meta["name"],
            lambda d: d.update(status=status),
            "status",
        )

    # ---- Jobs -----------------------------------------------------------------------------

    def _job(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        meta, spec = job["metadata"], job["spec"]
        status = dict(job.get("status") or {})
        conditions = list(status.get("conditions") or [])
        if any(c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in conditions):
            return
        phases = [(p.get("status") or {}).get("phase") for p in pods]
        succeeded = phases.count("Succeeded")
        active = [
            p for p, phase in zip(pods, phases, strict=True) if phase not in ("Succeeded", "Failed")
        ]
        # Each failed pod meets the podFailurePolicy: FailJob ends the Job, Ignore leaves the
        # pod out of `failed` and the backoff limit, Count (or no rule) counts it.
        rules = (spec.get("podFailurePolicy") or {}).get("rules") or []
        counted: list[dict[str, Any]] = []
        fail_job: str | None = None
        for pod in sorted(
            (p for p, phase in zip(pods, phases, strict=True) if phase == "Failed"),
            key=_finished,
        ):
            action, why = pod_failure_action(rules, pod)
            if action == "FailJob" and fail_job is None:
                fail_job = why
            if action != "Ignore":
                counted.append(pod)
        failed = len(counted)
        status.setdefault("startTime", now_rfc3339())
        started = datetime.strptime(status["startTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        deadline = spec.get("activeDeadlineSeconds")
        finished: tuple[str, str, str] | None = None
        if succeeded >= int(spec.get("completions", 1)):
            finished = (
                "Complete",
                "CompletionsReached",
                "Reached expected number of succeeded pods",
            )
        elif fail_job is not None:
            finished = ("Failed", "PodFailurePolicy", fail_job)
        elif failed > int(spec.get("backoffLimit", 6)):
            finished = (
                "Failed",
                "BackoffLimitExceeded",
                "Job has reached the specified backoff limit",
            )
        elif deadline is not None and time.time() - started.timestamp() >= float(deadline):
            finished = (
                "Failed",
                "DeadlineExceeded",
                "Job was active longer than specified deadline",
            )
        elif not active and time.time() >= _retry_at(counted):
            name = f"{meta['name']}-{random_suffix()}"
            extra = {"batch.kubernetes.io/job-name": meta["name"], "job-name": meta["name"]}
            active = [
                self.store.create(self.pods, meta["namespace"], pod_from_template(job, name, extra))
            ]
        if finished is not None and finished[0] == "Failed":
            for pod in active:
                self._delete_pod(pod)
            active = []
        if finished is not None:
            kind, reason, message = finished
            interim = "SuccessCriteriaMet" if kind == "Complete" else "FailureTarget"
            for step in (interim, kind):
                conditions = set_condition(
                    conditions, step, "True", reason, message, lastProbeTime=now_rfc3339()
                )
            if kind == "Complete":
                status["completionTime"] = now_rfc3339()
        counts = {"active": len(active), "succeeded": succeeded, "failed": failed}
        status.update(counts)
        status = {k: v for k, v in status.items() if v or k not in counts}
        status["ready"] = sum(pod_ready(p) for p in active)
        status["terminating"] = 0
        if conditions:
            status["conditions"] = conditions
        self.store.update(
            self.jobs, meta["namespace"], meta["name"], lambda j: j.update(status=status), "status"
        )


def pod_failure_action(rules: list[dict[str, Any]], pod: dict[str, Any]) -> tuple[str, str]:
    """The action of the first podFailurePolicy rule a failed pod matches (Count when none
    does), with the words Kubernetes puts in a FailJob condition's message. onExitCodes looks
    at non-zero exit codes only, of `containerName` when the rule names one."""
    meta = pod["metadata"]
    where = f"{meta.get('namespace')}/{meta['name']}"
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for index, rule in enumerate(rules):
        action = rule.get("action", "Count")
        exits = rule.get("onExitCodes")
        if exits is not None:
            values = set(exits.get("values") or [])
            for container in statuses:
                if exits.get("containerName") not in (None, container.get("name")):
                    continue
                code = ((container.get("state") or {}).get("terminated") or {}).get("exitCode")
                if not code:
                    continue
                if (code in values) == (exits.get("operator", "In") == "In"):
                    return action, (
                        f"Container {container.get('name')} for pod {where} failed with exit "
                        f"code {code} matching {action} rule at index {index}"
                    )
        for wanted in rule.get("onPodConditions") or []:
            found = condition(pod, wanted.get("type", ""))
            if found is not None and found.get("status") == wanted.get("status", "True"):
                return action, (
                    f"Pod {where} has condition {wanted.get('type')} matching {action} rule "
                    f"at index {index}"
                )
    return "Count", ""


def _finished(pod: dict[str, Any]) -> float:
    """When a failed pod's last container stopped (its creation when none recorded it)."""
    stamps = [
        terminated["finishedAt"]
        for status in (pod.get("status") or {}).get("containerStatuses") or []
        if (terminated := (status.get("state") or {}).get("terminated") or {}).get("finishedAt")
    ]
    if not stamps:
        return _created(pod)
    return datetime.strptime(max(stamps), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _retry_at(counted: list[dict[str, Any]]) -> float:
    """When the next pod may start after `counted` failures: Kubernetes' exponential backoff
    (10 s doubling up to 6 min) shortened for tests, JOB_BACKOFF_SECONDS doubling up to
    JOB_BACKOFF_MAX_SECONDS after the last counted failure."""
    if not counted:
        return 0.0
    delay = min(JOB_BACKOFF_SECONDS * 2 ** (len(counted) - 1), JOB_BACKOFF_MAX_SECONDS)
    return _finished(counted[-1]) + delay


def _created(pod: dict[str, Any]) -> float:
    stamp = pod["metadata"].get("creationTimestamp", "1970-01-01T00:00:00Z")
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
