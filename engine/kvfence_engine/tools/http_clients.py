"""httpx clients that share one TLS context. httpx builds a context for every client it makes
(certifi's CA bundle, about 35 ms of CPU), and a client made per call pays that each time: the
operator's pool reads and backend pushes on every pass, readiness polls, the test suite's
waits. Every address kvfence dials for itself is plain http, inside the cluster or on the
machine; an https one still verifies, through this context."""

from typing import Any

import httpx

TLS = httpx.create_ssl_context()


def client(**options: Any) -> httpx.Client:
    """httpx.Client(**options), without a TLS context of its own."""
    return httpx.Client(verify=TLS, **options)


def get(url: str, **options: Any) -> httpx.Response:
    """httpx.get(url, **options), without a TLS context of its own."""
    return httpx.get(url, verify=TLS, **options)
