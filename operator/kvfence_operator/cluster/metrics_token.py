"""The operator's side of metrics access (builders/metrics.py): the metrics token, and the
scrapers, from the settings the chart passes in the environment.

The token lives in a Secret in the operator's own namespace (`KVFENCE_METRICS_TOKEN_SECRET`,
key `token`), where the chart's PodMonitor reads it for Prometheus. At start-up the operator
creates it with a fresh random token; a 409 means it exists (a restart, another replica, or
a Secret a GitOps tool or the platform team put there), and the one there is kept, never
regenerated. Then the operator reads it, by name, in its own namespace only, and gives the
pods its SHA-256. Rotating it: replace the Secret's `token` and restart the operator; every
engine and router pod then restarts with the new digest (their Deployments change)."""

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvfence_operator.builders.metrics import MetricsAccess
from kvfence_operator.cluster.own_secrets import SecretStore, own_secret_value

TOKEN_SECRET_ENV = "KVFENCE_METRICS_TOKEN_SECRET"  # unset or empty: no metrics token
SCRAPERS_ENV = "KVFENCE_METRICS_SCRAPERS"  # NetworkPolicy peers, a JSON list; unset: no rule
TOKEN_KEY = "token"
SELECTORS = ("namespaceSelector", "podSelector")
SELECTOR_FIELDS = ("matchLabels", "matchExpressions")


def scrapers_from(text: str | None) -> list[dict[str, Any]]:
    """The scrapers' NetworkPolicy peers from `KVFENCE_METRICS_SCRAPERS`: a JSON list of
    objects with a namespaceSelector and/or a podSelector, each a label selector (empty or
    unset: none). ValueError says what is wrong with it."""
    if not text:
        return []
    try:
        peers = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{SCRAPERS_ENV} is not JSON: {exc}") from exc
    if not isinstance(peers, list):
        raise ValueError(f"{SCRAPERS_ENV} must be a list of NetworkPolicy peers, got {text}")
    for peer in peers:
        if not isinstance(peer, dict) or not peer or set(peer) - set(SELECTORS):
            raise ValueError(
                f"{SCRAPERS_ENV}: each peer must be an object with namespaceSelector and/or "
                f"podSelector, got {json.dumps(peer)}"
            )
        for key, value in peer.items():
            if not isinstance(value, dict) or set(value) - set(SELECTOR_FIELDS):
                raise ValueError(
                    f"{SCRAPERS_ENV}: {key} must be a label selector (matchLabels, "
                    f"matchExpressions), got {json.dumps(value)}"
                )
    return peers


def metrics_token_sha256(kube: SecretStore, namespace: str, name: str) -> str:
    """Create the metrics token Secret if it is missing (create-and-409: one that exists is
    kept), read it, and return the token's SHA-256 in hex."""
    token = own_secret_value(kube, namespace, name, TOKEN_KEY, "metrics token")
    return hashlib.sha256(token.encode()).hexdigest()


def metrics_access(kube: SecretStore, namespace: str, env: Mapping[str, str]) -> MetricsAccess:
    scrapers = scrapers_from(env.get(SCRAPERS_ENV))
    name = env.get(TOKEN_SECRET_ENV)
    digest = metrics_token_sha256(kube, namespace, name) if name else None
    return MetricsAccess(token_sha256=digest, scrapers=scrapers)
