"""Secrets in the operator's own namespace, the only Secrets it reads: created at start-up
when missing (create-and-409: one that exists, put there by a restart, another replica, a
GitOps tool or the platform team, is kept and never regenerated), then read by name. The chart
grants `create` on Secrets and `get` on these names, in that namespace only.

- the metrics token (kvfence_operator/cluster/metrics_token.py);
- the credentials key (`KVFENCE_CREDENTIALS_KEY_SECRET`, default `kvfence-credentials-key`,
  key `key`; empty: none, and every revision is read from its Secret), from which every
  revision's credentials are derived (builders/secret.py::RevisionCredentials.derive), so the
  operator never reads a Secret in the workload namespaces. Deleting or changing it does not
  change a running revision's credentials (its Secret is immutable), but the operator can then
  only read them from that Secret, which needs `rbac.legacyRevisionSecrets`: keep it, like a
  CA key."""

import base64
import secrets
from collections.abc import Mapping
from typing import Any, Protocol

CREDENTIALS_KEY_SECRET_ENV = "KVFENCE_CREDENTIALS_KEY_SECRET"  # empty: no key (legacy reads)
CREDENTIALS_KEY_SECRET = "kvfence-credentials-key"  # unset: this one, as the chart names it
CREDENTIALS_KEY_KEY = "key"


class SecretStore(Protocol):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any: ...
    def create(self, obj: dict[str, Any]) -> bool: ...


def own_secret_value(kube: SecretStore, namespace: str, name: str, key: str, what: str) -> str:
    """Create the Secret `namespace/name` with a fresh random value under `key` if it is
    missing (one that exists is kept), read it, and return that value."""
    fresh = base64.b64encode(secrets.token_urlsafe(32).encode()).decode()
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/managed-by": "kvfence-operator"},
            },
            "type": "Opaque",
            "data": {key: fresh},
        }
    )
    found = kube.get("v1", "Secret", namespace, name)
    data = (found or {}).get("data") or {}
    value = base64.b64decode(data.get(key) or "").decode().strip()
    if not value:
        raise ValueError(
            f"Secret {namespace}/{name} has no {key!r}: put the {what} there, or delete the "
            "Secret and the operator makes one"
        )
    return value


def credentials_key(kube: SecretStore, namespace: str, env: Mapping[str, str]) -> bytes | None:
    name = env.get(CREDENTIALS_KEY_SECRET_ENV, CREDENTIALS_KEY_SECRET)
    if not name:
        return None
    return own_secret_value(kube, namespace, name, CREDENTIALS_KEY_KEY, "credentials key").encode()
