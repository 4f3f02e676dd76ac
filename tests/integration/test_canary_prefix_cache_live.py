"""The canary's prefix-cache check against real router + prefill + decode processes with
--prefix-cache (tiny-random): a healthy deployment passes, tenant A's repeat hitting its own
cache; the cross-tenant-prefix fault on prefill fails it (the read check refuses tenant B, and
the foreign-tenant counter rises), and with no-tag-check as well the canary sees the leak."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.deployments import Deployment, start_deployment, two_tenant_router_args
from kvfence_engine.canary import CanaryConfig, CanaryReport, run_canary

KEY_A, KEY_B, TOKEN = "prefix-canary-a", "prefix-canary-b", "prefix-canary-token"
# As in test_canary_deployments: long enough that a cold prefill stands out of request jitter
# (the timing half of the check judges only prefills of at least 0.15 s).
HEALTHY_CONTEXT = 3072
SMALL_CONTEXT = 512  # the broken ones fail on what usage and status say; timing is not needed


@pytest.fixture(scope="module")
def router_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return two_tenant_router_args(tmp_path_factory.mktemp("prefix-canary"), KEY_A, KEY_B, TOKEN)


def cached(
    logs: Path, name: str, router_args: list[str], context: int, faults: tuple[str, ...] = ()
) -> Deployment:
    return start_deployment(
        logs,
        name,
        context=context,
        pages=2 * context // 16,
        router_args=router_args,
        engine_args=["--prefix-cache", "--prefix-cache-tenants", "2"],
        prefill_faults=faults,
    )


def canary(d: Deployment) -> CanaryReport:
    config = CanaryConfig(d.router.url, KEY_A, KEY_B, internal_token=TOKEN, rounds=1)
    report = run_canary(config)
    print(report.human())  # shown when a test fails
    return report


def failed(report: CanaryReport) -> dict[str, str]:
    return {c.name: c.reason for c in report.checks if not c.passed}


@pytest.fixture(scope="module")
def healthy(logs_dir: Path, router_args: list[str]) -> Iterator[Deployment]:
    d = cached(logs_dir, "canary-prefix", router_args, HEALTHY_CONTEXT)
    yield d
    d.stop()


def test_a_healthy_deployment_with_the_cache_passes_and_its_owner_hits(
    healthy: Deployment,
) -> None:
    report = canary(healthy)
    assert report.exit_code == 0 and failed(report) == {}, report.reason
    assert report.facts is not None and report.facts["prefix_cache"] is True
    checks = {c.name: c for c in report.checks}
    prefix = checks["prefix_cache"]
    assert prefix.reason.startswith("tenant A's repeat hit its own cache"), prefix.reason
    assert prefix.inputs["intruder_cached_tokens"] == [0]
    assert prefix.inputs["owner_cached_tokens"][-1] > 0
    # B's replayed probes hit B's own cache, which the latency floor allows for what they
    # report; the replays still agree token for token with the cold answers
    assert checks["latency_floor"].passed and checks["differential_replay"].passed
    own_hits = [
        a
        for a in report.answers
        if a["tenant"] == "B" and a["probe"] != "prefix-intruder" and a["usage_cached_tokens"]
    ]
    assert own_hits, "tenant B's replayed probes never hit its own cache"


def test_cross_tenant_prefix_on_prefill_fails_the_canary(
    logs_dir: Path, router_args: list[str]
) -> None:
    d = cached(
        logs_dir, "canary-prefix-cross", router_args, SMALL_CONTEXT, ("cross-tenant-prefix",)
    )
    try:
        report = canary(d)
    finally:
        d.stop()
    assert report.exit_code == 1
    reasons = failed(report)
    assert reasons["prefix_cache"].startswith(
        "tenant B sending tenant A's exact prompt (512 tokens) got 500 kv_isolation_violation"
    ), reasons
    assert "kvfence_kv_foreign_tenant_read_total on prefill" in reasons["engine_counters"]


def test_cross_tenant_prefix_without_the_read_check_shows_the_leak_to_the_canary(
    logs_dir: Path, router_args: list[str]
) -> None:
    faults = ("cross-tenant-prefix", "no-tag-check")
    d = cached(logs_dir, "canary-prefix-leak", router_args, SMALL_CONTEXT, faults)
    try:
        report = canary(d)
    finally:
        d.stop()
    assert report.exit_code == 1
    reasons = failed(report)
    # A's slot of the cache partition holds 8 of the prompt's 31 full pages (64 pages: 16 are
    # the cache's, in 2 slots)
    assert reasons["prefix_cache"].startswith(
        "tenant B sending tenant A's exact prompt (512 tokens) was told 128 of its tokens were "
        "cached: a hit on tenant A's prefix-cache pages"
    ), reasons
