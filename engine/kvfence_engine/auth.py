"""Checking a secret a caller presents: the router's API keys, the internal token on
/internal/* calls, on the operational endpoints (/metrics, /v1/kvpool) and on a KV transfer's
HELLO, and the metrics token on /metrics."""

import hashlib
import hmac
from collections.abc import Mapping

from kvfence_engine.contracts import TOKEN_HEADER


def secret_matches(presented: object, expected: str) -> bool:
    """Whether `presented` is `expected`, in time that does not depend on where they differ.

    Anything a caller can send compares as bytes: `hmac.compare_digest` refuses str with a
    non-ASCII character (TypeError), and a header or a JSON string can carry one, or even a
    lone surrogate. Anything that is not a string (None, a number) matches nothing."""
    if isinstance(presented, str):
        presented = presented.encode("utf-8", "surrogatepass")
    if not isinstance(presented, bytes) or not presented:
        return False
    return hmac.compare_digest(presented, expected.encode("utf-8", "surrogatepass"))


def bearer_of(headers: Mapping[str, str]) -> str:
    """The token of `Authorization: Bearer <token>`, or "" when there is none."""
    header = headers.get("authorization", "")
    return header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""


def presents_internal_token(headers: Mapping[str, str], expected: str) -> bool:
    """Whether a request carries the internal token: in X-Kvfence-Internal-Token, or as a
    bearer token (how Prometheus authenticates a scrape)."""
    return secret_matches(headers.get(TOKEN_HEADER), expected) or secret_matches(
        bearer_of(headers), expected
    )


def presents_metrics_token(headers: Mapping[str, str], sha256: bytes | None) -> bool:
    """Whether a scrape carries the metrics token, known here by its SHA-256 only (so it can sit
    in a pod's arguments), as a bearer token: Prometheus's way. It opens /metrics and nothing
    else, so it is never accepted in X-Kvfence-Internal-Token."""
    presented = bearer_of(headers)
    if sha256 is None or not presented:
        return False
    digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(digest, sha256)
