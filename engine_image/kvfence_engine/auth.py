"""Checking a secret a caller presents: the router's API keys, the internal token on
/internal/* calls and on a KV transfer's HELLO."""

import hmac


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
