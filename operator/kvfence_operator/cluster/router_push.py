"""The operator pushes each revision's backends to its router pods, so a router stops sending
to a deleted or failing engine within one pass, not when the kubelet refreshes the ConfigMap
volume (about a minute later in Kubernetes).

The ConfigMap stays the start-up source: a router that starts reads it, then gets pushes. Both
carry the same BackendsFile with a version; the router keeps the newest it was given, so the
late volume refresh never rolls a push back. The version grows whenever the set changes and
survives an operator restart (it is read back from the ConfigMap); a ConfigMap written anew
starts from the clock in milliseconds, above anything an earlier one held.
"""

import logging
import time
from collections.abc import Callable, Iterable

import httpx
from pydantic import ValidationError

from kvfence_engine.contracts import TOKEN_HEADER, BackendsFile, BackendsInForce
from kvfence_engine.tools import http_clients

log = logging.getLogger(__name__)

BACKENDS_PATH = "/internal/v1/backends"
PUSH_TIMEOUT_SECONDS = 2.0  # per call: a hung router must not stall the pass

BackendsPusher = Callable[[Iterable[str], BackendsFile, str | None], None]


def written_backends(data_text: str | None) -> BackendsFile | None:
    """The BackendsFile a ConfigMap holds, or None (none yet, or not one)."""
    if not data_text:
        return None
    try:
        return BackendsFile.model_validate_json(data_text)
    except ValidationError:
        return None


def versioned(wanted: BackendsFile, written: BackendsFile | None, now_ms: int) -> BackendsFile:
    """`wanted` with its version: the written one's when nothing else changed (a pass that
    changes nothing writes and pushes nothing), else newer than both it and the clock. A
    written version 0 (the ConfigMap as first created, or created anew after someone deleted
    it) is never kept: routers may hold a newer set, which a version 0 could not replace."""
    unversioned = wanted.model_copy(update={"version": 0})
    if (
        written is not None
        and written.version > 0
        and written.model_copy(update={"version": 0}) == unversioned
    ):
        return wanted.model_copy(update={"version": written.version})
    previous = written.version if written is not None else 0
    return wanted.model_copy(update={"version": max(previous + 1, now_ms)})


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def push_backends(router_urls: Iterable[str], wanted: BackendsFile, token: str | None) -> None:
    """Give `wanted` to each router that does not hold it yet (by digest). Failures are
    logged: the next pass tries again, and the ConfigMap still reaches the router, late."""
    if token is None:
        log.warning("backends of revision %s not pushed: no internal token", wanted.revision)
        return
    headers = {TOKEN_HEADER: token}
    digest = wanted.digest()
    body = wanted.model_dump(mode="json", by_alias=True)
    with http_clients.client(timeout=PUSH_TIMEOUT_SECONDS, headers=headers) as client:
        for url in router_urls:
            try:
                held = client.get(url + BACKENDS_PATH)
                held.raise_for_status()
                if BackendsInForce.model_validate_json(held.content).digest == digest:
                    continue
                pushed = client.put(url + BACKENDS_PATH, json=body)
                if pushed.status_code != 200:
                    log.warning(
                        "router %s refused backends version %d: %s %s",
                        url,
                        wanted.version,
                        pushed.status_code,
                        pushed.text[:300],
                    )
            except (httpx.HTTPError, ValueError) as exc:  # ValidationError is a ValueError
                log.warning("backends not pushed to router %s: %r", url, exc)
