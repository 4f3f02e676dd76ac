"""The few Kubernetes API verbs the operator uses, on plain dict manifests.

Dicts in and out, so the builders' output is exactly what gets sent.
"""

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from urllib3.util.retry import Retry

from kvfence_operator.crd.types import API_GROUP, API_VERSION, KIND, PLURAL

MERGE_PATCH = "application/merge-patch+json"

# (apiVersion, kind) -> plural; every kind the operator manages is namespaced.
_PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "ReplicaSet"): "replicasets",  # read only: whose a pod is
    ("batch/v1", "Job"): "jobs",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    (f"{API_GROUP}/{API_VERSION}", KIND): PLURAL,
}


class NoClusterAccess(RuntimeError):
    """Neither config the operator looks for works; the message names both and the fix."""


def load_cluster_config() -> None:
    """In a pod: the service account. Elsewhere: $KUBECONFIG or ~/.kube/config."""
    try:
        config.load_incluster_config()
        return
    except config.ConfigException as exc:
        in_cluster = str(exc).rstrip(".")
    kubeconfig = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    try:
        config.load_kube_config()
    except (config.ConfigException, OSError) as exc:
        raise NoClusterAccess(
            f"no cluster access: not in a pod (service account: {in_cluster}) and the "
            f"kubeconfig {kubeconfig} (KUBECONFIG or ~/.kube/config) cannot be used "
            f"({str(exc).rstrip('.')}); point KUBECONFIG at a kubeconfig file, or run the "
            "operator in a pod with a service account"
        ) from None


# Answers that say "try again" (API priority and fairness' 429, an apiserver or etcd blip):
# retried inside the call, so one of them neither escapes the pass into kopf's 60 s backoff nor
# shows as Degraded. A create retried after a 500 that had been stored meets a 409, which the
# callers read as "it exists"; patches are merge patches and deletes ignore 404, so every verb
# may be retried.
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_AFTER_MAX_S = 5  # a server's Retry-After, at most: a pass must not stall on one call


def with_retries(configuration: client.Configuration) -> client.Configuration:
    """`configuration`, its calls retried on a transient answer by urllib3 (the official
    client's transport): three retries, after the server's Retry-After (at most
    RETRY_AFTER_MAX_S) or a short exponential backoff; the last answer is returned as it is,
    so an error that lasts still reaches the caller as a KubeError."""
    configuration.retries = Retry(
        total=3,
        connect=3,
        read=1,
        status=3,
        allowed_methods=None,  # every verb: see TRANSIENT_STATUSES
        status_forcelist=TRANSIENT_STATUSES,
        backoff_factor=0.25,
        backoff_max=2.0,
        respect_retry_after_header=True,
        retry_after_max=RETRY_AFTER_MAX_S,
        raise_on_status=False,
    )
    return configuration


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path} answered {status}: {body[:300]}")
        self.status = status
        self.body = body


def label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    try:
        plural = _PLURALS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not manage {api_version} {kind}") from None
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


@dataclass
class Kube:
    """Raw REST through the official client's ApiClient (its auth, TLS and kubeconfig
    handling), without its typed models: manifests stay the builders' dicts."""

    api: client.ApiClient
    timeout: float = 10.0

    def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        request = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=dict(body) if body is not None else None,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request, _request_timeout=self.timeout)
        data = response.read() or b"{}"
        if not 200 <= response.status < 300:
            raise KubeError(response.status, method, path, data.decode(errors="replace"))
        return dict(json.loads(data))

    def document(self, path: str) -> dict[str, Any] | None:
        """GET a non-resource path (an OpenAPI document); None for 404."""
        try:
            return self._call("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", f"{collection_path(api_version, kind, namespace)}/{name}")
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        found = self._call(
            "GET",
            collection_path(api_version, kind, namespace),
            query={"labelSelector": label_selector(labels)},
        )
        # Filter again: a selector is a promise a server may not keep (test emulators).
        return [
            item
            for item in found.get("items") or []
            if all((item["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    def create(self, obj: Mapping[str, Any], dry_run: bool = False) -> bool:
        """True if created, False if it already existed (a restart, or a concurrent create).
        dry_run: nothing is stored; True means the name is free (whether a Secret exists,
        asked without the right to read it)."""
        if not dry_run:
            return self.create_object(obj) is not None
        path = collection_path(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"])
        try:
            self._call("POST", path, obj, query={"dryRun": "All"})
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def create_object(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """The created object as the API answered it; None if the name was taken (409)."""
        path = collection_path(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"])
        try:
            return self._call("POST", path, obj)
        except KubeError as exc:
            if exc.status == 409:
                return None
            raise

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str = "",
    ) -> dict[str, Any]:
        """The patched object as the API answered it."""
        path = f"{collection_path(api_version, kind, namespace)}/{name}"
        if subresource:
            path += f"/{subresource}"
        return self._call("PATCH", path, patch, content_type=MERGE_PATCH)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        path = f"{collection_path(api_version, kind, namespace)}/{name}"
        try:
            self._call("DELETE", path, {"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status != 404:
                raise


def api_message(exc: KubeError) -> str:
    """The API server's own message from a Status body, else the error's text."""
    try:
        body = json.loads(exc.body)
    except ValueError:
        return str(exc)
    message = body.get("message") if isinstance(body, dict) else None
    return str(message) if message else str(exc)
