"""The per-revision Secret: the internal token engines require on reserve, prefill and transfer,
the two canary tenants' API keys, and the prefix cache's two secrets (the prefill engines' page
keys, the routers' placement; mounted only where spec.engine.prefixCache is on)."""

import base64
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvfence_operator.builders.pod_template import CREDENTIALS_DIR
from kvfence_operator.meta import Instance, child_name, labels, object_meta

INTERNAL_TOKEN_KEY = "internal-token"
CANARY_TENANT_A_KEY = "canary-tenant-a-key"
CANARY_TENANT_B_KEY = "canary-tenant-b-key"
CANARY_API_KEYS_KEY = "canary-api-keys"  # the same two keys in the router's keys-file format
CANARY_TENANTS = ("kvfence-canary-a", "kvfence-canary-b")
USER_API_KEYS_KEY = "api-keys"  # key inside spec.router.apiKeysSecret
PREFIX_CACHE_SECRET_KEY = "prefix-cache-secret"
ROUTING_SECRET_KEY = "routing-secret"
PREFIX_CACHE_SECRET_FILE = f"{CREDENTIALS_DIR}/{PREFIX_CACHE_SECRET_KEY}"
ROUTING_SECRET_FILE = f"{CREDENTIALS_DIR}/{ROUTING_SECRET_KEY}"


def _new_secret() -> str:
    return secrets.token_urlsafe(32)


def secret_name(instance: Instance, revision: str) -> str:
    return child_name(instance, revision, "credentials")


@dataclass(frozen=True, slots=True)
class RevisionCredentials:
    internal_token: str
    tenant_a_key: str
    tenant_b_key: str
    # keys the prefill engines' prefix cache and the routers' prefix-aware placement
    prefix_cache_secret: str = field(default_factory=_new_secret)
    routing_secret: str = field(default_factory=_new_secret)

    def __post_init__(self) -> None:
        values = (self.internal_token, self.tenant_a_key, self.tenant_b_key)
        for value in (*values, self.prefix_cache_secret, self.routing_secret):
            if len(value) < 32 or any(c.isspace() for c in value):
                raise ValueError("credentials must be at least 32 characters without whitespace")

    @classmethod
    def generate(cls) -> "RevisionCredentials":
        return cls(*(_new_secret() for _ in range(5)))

    def api_keys_file(self) -> str:
        """One 'KEY TENANT' per line, as `kvfence router --api-keys` reads it."""
        keys = (self.tenant_a_key, self.tenant_b_key)
        return "".join(
            f"{key} {tenant}\n" for key, tenant in zip(keys, CANARY_TENANTS, strict=True)
        )


def internal_token_volume(
    instance: Instance, revision: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The revision's internal token, read-only at pod_template.INTERNAL_TOKEN_FILE: the
    engines require it, the router sends it, the canary reads the router's /metrics with it."""
    volume = {
        "name": "credentials",
        "secret": {
            "secretName": secret_name(instance, revision),
            "items": [{"key": INTERNAL_TOKEN_KEY, "path": "internal-token"}],
            "defaultMode": 0o440,
        },
    }
    return volume, {"name": "credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True}


def prefix_cache_secret_item() -> dict[str, str]:
    """The prefill engines' page-key secret, as one more item of the credentials volume."""
    return {"key": PREFIX_CACHE_SECRET_KEY, "path": PREFIX_CACHE_SECRET_KEY}


def routing_secret_item() -> dict[str, str]:
    """The routers' placement secret, as one more item of the credentials volume."""
    return {"key": ROUTING_SECRET_KEY, "path": ROUTING_SECRET_KEY}


def internal_token_of(secret: dict[str, Any] | None) -> str | None:
    """The internal token in a revision Secret as the API server returns it (base64 data)."""
    data = (secret or {}).get("data") or {}
    if INTERNAL_TOKEN_KEY not in data:
        return None
    return base64.b64decode(data[INTERNAL_TOKEN_KEY]).decode()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def build_revision_secret(
    instance: Instance, revision: str, credentials: RevisionCredentials
) -> dict[str, Any]:
    """Immutable: a revision keeps its token and keys for its whole life."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(
            instance, secret_name(instance, revision), labels(instance, revision)
        ),
        "type": "Opaque",
        "immutable": True,
        "data": {
            INTERNAL_TOKEN_KEY: _b64(credentials.internal_token),
            CANARY_TENANT_A_KEY: _b64(credentials.tenant_a_key),
            CANARY_TENANT_B_KEY: _b64(credentials.tenant_b_key),
            CANARY_API_KEYS_KEY: _b64(credentials.api_keys_file()),
            PREFIX_CACHE_SECRET_KEY: _b64(credentials.prefix_cache_secret),
            ROUTING_SECRET_KEY: _b64(credentials.routing_secret),
        },
    }
