"""The canary's prefix-cache verdicts as pure functions of recorded answers: tenant B sending
tenant A's exact prompt must get no cached tokens and no first token sooner than a cold prefill;
tenant A repeating it must hit when the target says its cache is on; B's own hits may be fast
only by the tokens they report cached; a foreign-tenant read is a counter that must not rise."""

from kvfence_engine.canary.checks import (
    check_engine_counters,
    check_latency_floor,
    check_prefix_cache,
)
from kvfence_engine.canary.counters import parse_counters
from kvfence_engine.canary.observations import (
    CALIBRATION,
    PREFIX_INTRUDER,
    PREFIX_OWNER,
    Answer,
)
from kvfence_engine.canary.target import _read_chunk

N = 1024  # prompt length; calibrated: 1000 tokens prefill in 0.5 s over 0.05 s of overhead


def answer(tenant: str, probe: str, context: str, n: int, **kw: object) -> Answer:
    fields = {"status": 200, "seconds": 0.6, "usage_prompt_tokens": n, "ttft": 0.55} | kw
    return Answer(tenant, probe, context, n, **fields)  # type: ignore[arg-type]


def calibration() -> list[Answer]:
    return [
        answer("B", CALIBRATION, CALIBRATION, 1, ttft=0.05),
        answer("B", CALIBRATION, CALIBRATION, 1000, ttft=0.55),
    ]


def probed(intruder: dict[str, object], repeat_cached: int = 1008) -> list[Answer]:
    return [
        *calibration(),
        answer("A", PREFIX_OWNER, "prefix-cold", N, usage_cached_tokens=0),
        answer("A", PREFIX_OWNER, "prefix-repeat-1", N, usage_cached_tokens=repeat_cached),
        answer(
            "B", PREFIX_INTRUDER, "prefix-intruder", N, **({"usage_cached_tokens": 0} | intruder)
        ),
    ]


def test_a_healthy_cache_passes_hitting_for_its_owner_and_missing_for_the_other_tenant() -> None:
    result = check_prefix_cache(probed({}), True, 4, 0.15)
    assert result.passed, result.reason
    assert result.reason.startswith("tenant A's repeat hit its own cache (1008 cached tokens)")
    assert result.inputs["timed"] == 1


def test_the_other_tenant_reported_a_hit_on_a_s_pages_fails() -> None:
    result = check_prefix_cache(probed({"usage_cached_tokens": 1008, "ttft": 0.06}), True, 4, 0.15)
    assert not result.passed
    assert result.findings[0] == (
        "tenant B sending tenant A's exact prompt (1024 tokens) was told 1008 of its tokens were "
        "cached: a hit on tenant A's prefix-cache pages"
    )
    assert "sooner than a cold prefill of 1000 tokens allows (0.175s)" in result.findings[1]


def test_a_hit_the_usage_hides_still_shows_in_the_first_token_time() -> None:
    result = check_prefix_cache(probed({"ttft": 0.06}), True, 4, 0.15)
    assert not result.passed and "had its first token after 0.060s" in result.reason


def test_the_other_tenant_refused_by_the_read_check_fails() -> None:
    refused = {"status": 500, "error_code": "kv_isolation_violation", "ttft": None}
    result = check_prefix_cache(probed(refused), True, 4, 0.15)
    assert not result.passed
    assert result.reason == (
        "tenant B sending tenant A's exact prompt (1024 tokens) got 500 kv_isolation_violation"
    )


def test_a_cache_reported_on_that_never_hits_for_its_owner_fails() -> None:
    result = check_prefix_cache(probed({}, repeat_cached=0), True, 4, 0.15)
    assert not result.passed
    assert "reports the prefix cache on, but tenant A repeated its prompt 1 times" in result.reason


def test_with_the_cache_off_only_the_other_tenants_miss_is_checked_and_the_reason_says_so() -> None:
    answers = [a for a in probed({}) if a.context != "prefix-repeat-1"]
    result = check_prefix_cache(answers, False, 4, 0.15)
    assert result.passed
    assert result.reason.startswith(
        "the prefix cache is off (per /v1/kvpool), so tenant A's own hit was not checked"
    )


def test_nothing_probed_is_a_failure_not_a_pass() -> None:
    assert not check_prefix_cache(calibration(), True, 4, 0.15).passed
    owner_only = [a for a in probed({}) if a.probe != PREFIX_INTRUDER]
    assert not check_prefix_cache(owner_only, True, 4, 0.15).passed


def test_the_latency_floor_lets_b_s_own_hits_be_fast_by_the_tokens_they_report_cached() -> None:
    own_hit = answer("B", "within-limit", "after-A-1", N, ttft=0.06, usage_cached_tokens=1008)
    assert check_latency_floor([*calibration(), own_hit], 4, 0.15).passed
    hidden = answer("B", "within-limit", "after-A-1", N, ttft=0.06, usage_cached_tokens=0)
    result = check_latency_floor([*calibration(), hidden], 4, 0.15)
    assert not result.passed and "first token after 0.060s" in result.reason
    # a short hit leaves most of the prompt to compute: judged on that part
    part = answer("B", "within-limit", "after-A-1", N, ttft=0.06, usage_cached_tokens=16)
    assert not check_latency_floor([*calibration(), part], 4, 0.15).passed


FOREIGN = """
# TYPE kvfence_backend_up gauge
kvfence_backend_up{{role="prefill",backend="http://p"}} 1
# TYPE kvfence_backend_kv_tag_mismatch_total counter
kvfence_backend_kv_tag_mismatch_total{{role="prefill",backend="http://p"}} 0
# TYPE kvfence_backend_kv_unwritten_read_total counter
kvfence_backend_kv_unwritten_read_total{{role="prefill",backend="http://p"}} 0
# TYPE kvfence_backend_transfer_checksum_failed_total counter
kvfence_backend_transfer_checksum_failed_total{{role="prefill",backend="http://p"}} 0
# TYPE kvfence_backend_transfer_count_mismatch_total counter
kvfence_backend_transfer_count_mismatch_total{{role="prefill",backend="http://p"}} 0
{foreign}"""


def test_a_foreign_tenant_read_fails_the_counters_and_an_engine_without_it_does_not() -> None:
    series = (
        "# TYPE kvfence_backend_kv_foreign_tenant_read_total counter\n"
        'kvfence_backend_kv_foreign_tenant_read_total{{role="prefill",backend="http://p"}} {n}\n'
    )
    before = parse_counters(FOREIGN.format(foreign=series.format(n=0)))
    after = parse_counters(FOREIGN.format(foreign=series.format(n=1)))
    result = check_engine_counters(before, after)
    assert not result.passed
    assert result.reason == (
        "kvfence_kv_foreign_tenant_read_total on prefill http://p rose by 1 during the run"
    )
    older = parse_counters(FOREIGN.format(foreign=""))  # an engine from before the cache
    assert check_engine_counters(older, older).passed


def test_the_client_reads_cached_tokens_from_the_usage() -> None:
    a = answer("A", PREFIX_OWNER, "prefix-repeat-1", N, usage_prompt_tokens=None)
    usage = {"prompt_tokens": N, "prompt_tokens_details": {"cached_tokens": 1008}}
    _read_chunk(a, {"choices": [], "usage": usage}, lambda: None)
    assert (a.usage_prompt_tokens, a.usage_cached_tokens) == (N, 1008)
