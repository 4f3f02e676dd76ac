"""Which tenants a router answered, minute by minute (router/tenant_activity.py), and the
internal endpoint that tells the operator (GET /internal/v1/tenant-requests): the tenants a
standing canary's exposure window names."""

import time
from pathlib import Path

from helpers.router_app import KEY_A, KEY_B, TOKEN, bearer, router
from kvfence_engine.contracts import TOKEN_HEADER, TenantRequests
from kvfence_engine.router.tenant_activity import TenantActivity


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_requests_are_counted_per_tenant_in_the_minutes_of_a_window() -> None:
    clock = Clock(6000.0)  # minute 100
    activity = TenantActivity(clock)
    activity.record("team-a")
    clock.now = 6130.0  # minute 102
    activity.record("team-a")
    activity.record("team-b")
    clock.now = 6300.0  # minute 105
    activity.record("team-c")
    window = activity.between(6065.0, 6140.0)  # minutes 101 to 102, widened to whole minutes
    assert window.tenants == {"team-a": 1, "team-b": 1}
    assert (window.since, window.until) == (6060.0, 6180.0)
    assert activity.between(0.0, 7000.0).tenants == {"team-a": 2, "team-b": 1, "team-c": 1}
    assert window.covered_since == 6000.0  # it started then: nothing before is known


def test_minutes_older_than_the_retention_are_forgotten() -> None:
    clock = Clock(0.0)
    activity = TenantActivity(clock, retention=600)
    activity.record("team-a")
    clock.now = 1200.0
    activity.record("team-b")  # a new minute prunes the old ones
    window = activity.between(0.0, 1200.0)
    assert window.tenants == {"team-b": 1}
    assert window.covered_since == 600.0


def test_the_operator_reads_which_tenants_were_answered_and_a_tenant_cannot(
    tmp_path: Path,
) -> None:
    client = router(tmp_path)
    started = time.time()
    for key in (KEY_A, KEY_A, KEY_B):
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    client.get("/v1/models")  # unauthenticated: no tenant's
    client.get("/internal/v1/backends", headers={TOKEN_HEADER: TOKEN})  # the operator's
    query = {"since": started - 60, "until": time.time() + 1}
    read = client.get("/internal/v1/tenant-requests", params=query, headers={TOKEN_HEADER: TOKEN})
    assert read.status_code == 200, read.text
    assert TenantRequests.model_validate(read.json()).tenants == {"tenant-a": 2, "tenant-b": 1}
    # it names every tenant: a tenant's key does not open it
    assert client.get(
        "/internal/v1/tenant-requests", params=query, headers=bearer(KEY_A)
    ).status_code in (401, 403)
    backwards = {"since": 100.0, "until": 50.0}
    refused = client.get(
        "/internal/v1/tenant-requests", params=backwards, headers={TOKEN_HEADER: TOKEN}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "since"
