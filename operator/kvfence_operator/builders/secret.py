"""The per-revision Secret: the internal token engines require on reserve, prefill and transfer,
the two canary tenants' API keys, and the prefix cache's two secrets (the prefill engines' page
keys, the routers' placement; mounted only where spec.engine.prefixCache is on).

With the operator's credentials key (kvfence_operator/cluster/own_secrets.py) they are derived,
HMACs of the key over the revision's identity, so the operator knows them without reading the Secret
(no Secret `get` in the workload namespaces): it creates the Secret, and a 409 says it exists.
The revision's router ConfigMap records which key made them (CREDENTIALS_MARK); a revision
without the mark (made by an older operator: random credentials) is read from its Secret."""

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvfence_operator.builders.pod_template import CREDENTIALS_DIR
from kvfence_operator.meta import API_GROUP, Instance, child_name, labels, object_meta

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
CREDENTIALS_MARK = f"{API_GROUP}/credentials"  # router ConfigMap annotation: derived_mark(key)


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

    @classmethod
    def derive(cls, key: bytes, instance: Instance, revision: str) -> "RevisionCredentials":
        """HMAC-SHA256 of the credentials key over (purpose, namespace, name, uid, revision):
        each revision, and each object of a recreated name (a new uid), gets its own."""

        def one(purpose: str) -> str:
            who = (instance.namespace, instance.name, instance.uid, revision)
            parts = ("kvfence revision credentials v1", purpose, *who)
            digest = hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).digest()
            return base64.urlsafe_b64encode(digest).decode().rstrip("=")

        return cls(
            *(
                one(purpose)
                for purpose in (
                    INTERNAL_TOKEN_KEY,
                    CANARY_TENANT_A_KEY,
                    CANARY_TENANT_B_KEY,
                    PREFIX_CACHE_SECRET_KEY,
                    ROUTING_SECRET_KEY,
                )
            )
        )

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


def derived_mark(key: bytes) -> str:
    """What CREDENTIALS_MARK says of a revision whose credentials `key` derived: the key's
    fingerprint, so a replaced key is noticed (that revision is then read from its Secret)."""
    return "hmac-sha256:" + hashlib.sha256(b"kvfence credentials key\0" + key).hexdigest()[:16]


def serving_seal(secret: bytes, instance: Instance, revision: str) -> str:
    """What meta.ANNOTATION_SERVING holds on the stable Service the operator pointed at
    `revision`: the revision and an HMAC-SHA256 over (namespace, name, uid, revision). `secret`
    is the operator's credentials key, or without one the revision's internal token: whoever
    may patch the Service but holds neither cannot seal another revision."""
    who = (instance.namespace, instance.name, instance.uid, revision)
    message = "\0".join(("kvfence serving revision v1", *who)).encode()
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return f"{revision}:" + base64.urlsafe_b64encode(digest).decode().rstrip("=")


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
