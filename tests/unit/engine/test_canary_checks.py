"""The canary's verdicts as pure functions of recorded answers: each check passes on clean
records, fails on a doctored one with a reason naming what was wrong, and could not run (never
a pass, never a finding) when it had nothing to judge. Plus the probe plan, the report and the
exit codes (the import weight, in a fresh interpreter: tests/integration/test_commands.py)."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from kvfence_cli.main import main
from kvfence_engine.canary import report as report_module
from kvfence_engine.canary import run_canary
from kvfence_engine.canary.checks import (
    CheckResult,
    check_differential_replay,
    check_engine_counters,
    check_honest_usage,
    check_latency_floor,
    check_marker,
    check_status_codes,
)
from kvfence_engine.canary.config import CanaryConfig
from kvfence_engine.canary.counters import parse_counters
from kvfence_engine.canary.discovery import parse_pools
from kvfence_engine.canary.observations import (
    CALIBRATION,
    POLLUTION_FILL,
    POLLUTION_MARKER,
    Answer,
)
from kvfence_engine.canary.prompts import (
    boundary_probes,
    concurrent_probe,
    pollution_lengths,
    token_prompt,
)
from kvfence_engine.canary.report import CanaryReport, decide, write_termination_message
from kvfence_engine.canary.run import CanaryRun
from kvfence_engine.contracts import IMPLICATED_BACKENDS, TOKEN_HEADER
from kvfence_engine.tools.localproc import free_port

MARKER = "CANARY-0123456789abcdef"


def b(probe: str, context: str, n: int, **kw: object) -> Answer:
    fields = {"status": 200, "seconds": 0.5, "usage_prompt_tokens": n, "ttft": 0.4} | kw
    return Answer("B", probe, context, n, **fields)  # type: ignore[arg-type]


def polluted() -> list[Answer]:
    return [
        Answer("A", POLLUTION_MARKER, "after-A-1", None, 200, 0.1, flavour="A"),
        Answer("A", POLLUTION_FILL, "after-N-1", 90, 200, 0.1, flavour="N", usage_prompt_tokens=90),
    ]


def replay(**changes: object) -> list[Answer]:
    """B's in-limit-100 answered at baseline, after A's and after neutral pollution."""
    same = {"tokens": ["a", "b", "c"], "logprobs": [-0.5, -1.0, -2.0], "text": "abc"}
    return [
        *polluted(),
        b("in-limit-100", "baseline", 100, **same),
        b("in-limit-100", "after-A-1", 100, **(same | changes)),
        b("in-limit-100", "after-N-1", 100, **same),
    ]


# --- marker ------------------------------------------------------------------------------


def test_marker_passes_when_b_never_shows_it() -> None:
    result = check_marker([*polluted(), b("in-limit-100", "after-A-1", 100, text="hello")], MARKER)
    assert result.passed, result.reason


def test_marker_fails_when_eight_of_its_hex_digits_reach_b() -> None:
    leaked = b("in-limit-100", "after-A-1", 100, text="the code is 456789AB, I think")
    result = check_marker([*polluted(), leaked], MARKER)
    assert not result.passed
    assert "in-limit-100 (after-A-1)" in result.reason and "456789ab" in result.reason


def test_marker_fails_when_it_was_never_planted() -> None:
    failed = Answer("A", POLLUTION_MARKER, "after-A-1", None, 400, 0.1, flavour="A")
    result = check_marker([failed, b("in-limit-100", "after-A-1", 100, text="x")], MARKER)
    assert not result.passed and "never planted" in result.reason


# --- differential replay -----------------------------------------------------------------


def test_differential_replay_passes_on_identical_answers() -> None:
    result = check_differential_replay(replay(), 1e-3)
    assert result.passed and result.inputs["comparisons"] == 2


def test_differential_replay_fails_on_a_different_token() -> None:
    result = check_differential_replay(replay(tokens=["a", "X", "c"], text="aXc"), 1e-3)
    assert not result.passed
    assert result.reason.startswith("in-limit-100: the answer after-A-1 differs")
    assert "token 1 is 'X' instead of 'b'" in result.reason


def test_differential_replay_tolerates_logprob_noise_within_the_tolerance_only() -> None:
    assert check_differential_replay(replay(logprobs=[-0.5, -1.0005, -2.0]), 1e-3).passed
    result = check_differential_replay(replay(logprobs=[-0.5, -1.002, -2.0]), 1e-3)
    assert not result.passed and "logprob of token 1" in result.reason


def test_differential_replay_fails_when_nothing_was_answered_twice() -> None:
    result = check_differential_replay([*polluted(), b("in-limit-100", "baseline", 100)], 1e-3)
    assert not result.passed and "nothing to compare" in result.reason


# --- status codes ------------------------------------------------------------------------


def refused(n: int, status: int = 400, code: str = "context_length_exceeded") -> Answer:
    return b(f"over-limit-{n}", "after-A-1", n, status=status, error_code=code, ttft=None)


def test_status_codes_pass_when_over_limit_is_refused_and_within_is_answered() -> None:
    result = check_status_codes([b("in-limit-100", "baseline", 100), refused(101)], 100)
    assert result.passed, result.reason


def test_status_codes_fail_on_a_200_for_an_over_limit_prompt() -> None:
    result = check_status_codes([b("in-limit-100", "baseline", 100), b("over", "x", 101)], 100)
    assert not result.passed and "over the 100-token limit but was answered 200" in result.reason


def test_status_codes_fail_on_a_5xx_where_a_4xx_was_due() -> None:
    answers = [b("in-limit-100", "baseline", 100), refused(101, 500, "kv_isolation_violation")]
    result = check_status_codes(answers, 100)
    assert not result.passed and "a 500 where a 4xx refusal was due" in result.reason


@pytest.mark.parametrize("status", [401, 429])
def test_status_codes_do_not_take_auth_or_rate_limits_for_a_refusal(status: int) -> None:
    result = check_status_codes([b("in-limit-100", "baseline", 100), refused(101, status)], 100)
    assert not result.passed and "not a refusal of the prompt" in result.reason


def test_status_codes_fail_on_an_error_inside_a_200_stream_within_the_limit() -> None:
    broken = b("in-limit-100", "after-A-1", 100, stream_error=True, error_code="kv_isolation")
    result = check_status_codes([broken, refused(101)], 100)
    assert not result.passed and "whose stream ended in error kv_isolation" in result.reason


def test_status_codes_need_prompts_on_both_sides_of_the_limit() -> None:
    result = check_status_codes([b("in-limit-100", "baseline", 100)], 100)
    assert not result.passed and "both needed" in result.reason


# --- honest usage ------------------------------------------------------------------------


def test_honest_usage_fails_on_a_wrong_or_missing_count() -> None:
    assert check_honest_usage([b("p", "baseline", 100)]).passed
    wrong = check_honest_usage([b("p", "baseline", 100, usage_prompt_tokens=99)])
    assert not wrong.passed and "usage.prompt_tokens is 99 for a prompt of 100" in wrong.reason
    missing = check_honest_usage([b("p", "baseline", 100, usage_prompt_tokens=None)])
    assert not missing.passed and "no usage" in missing.reason
    assert not check_honest_usage([]).passed


# --- latency floor -----------------------------------------------------------------------


def calibration(prefill_1000: float) -> list[Answer]:
    return [
        b(CALIBRATION, CALIBRATION, 1, ttft=0.05),
        b(CALIBRATION, CALIBRATION, 1, ttft=0.07),
        b(CALIBRATION, CALIBRATION, 1000, ttft=0.05 + prefill_1000),
    ]


def test_latency_floor_fails_a_first_token_faster_than_the_prefill_can_be() -> None:
    # floor for >= 1000 tokens: 0.05 overhead + 0.5 / 4 = 0.175 s
    result = check_latency_floor(
        [*calibration(0.5), b("over-limit-1024", "x", 1024, ttft=0.06)], 4, 0.15
    )
    assert not result.passed
    assert "first token after 0.060s, but prefilling 1000 tokens takes 0.500s" in result.reason
    passes = check_latency_floor([*calibration(0.5), b("p", "x", 1024, ttft=0.2)], 4, 0.15)
    assert passes.passed and passes.inputs["answers_judged"] == 1


def test_latency_floor_judges_nothing_when_prefill_is_inside_the_noise() -> None:
    result = check_latency_floor([*calibration(0.02), b("p", "x", 1024, ttft=0.01)], 4, 0.15)
    assert result.passed and result.inputs["answers_judged"] == 0
    assert "no answer could be judged" in result.reason


def test_latency_floor_fails_without_a_calibration() -> None:
    assert not check_latency_floor([b("p", "x", 1024)], 4, 0.15).passed


# --- engine counters ---------------------------------------------------------------------

ROUTER_METRICS = """
# TYPE kvfence_backend_up gauge
kvfence_backend_up{{role="decode",backend="http://d"}} {up}
# TYPE kvfence_backend_kv_tag_mismatch_total counter
kvfence_backend_kv_tag_mismatch_total{{role="decode",backend="http://d"}} {tag}
# TYPE kvfence_backend_kv_unwritten_read_total counter
kvfence_backend_kv_unwritten_read_total{{role="decode",backend="http://d"}} 0
# TYPE kvfence_backend_transfer_checksum_failed_total counter
kvfence_backend_transfer_checksum_failed_total{{role="decode",backend="http://d"}} 0
# TYPE kvfence_backend_transfer_count_mismatch_total counter
kvfence_backend_transfer_count_mismatch_total{{role="decode",backend="http://d"}} 0
# TYPE kvfence_backend_late_writes_dropped_total counter
kvfence_backend_late_writes_dropped_total{{role="decode",backend="http://d"}} {late}
"""


def metrics(tag: int = 0, late: int = 0, up: int = 1) -> str:
    return ROUTER_METRICS.format(tag=tag, late=late, up=up)


def test_engine_counters_fail_when_an_isolation_counter_rises() -> None:
    result = check_engine_counters(parse_counters(metrics(2)), parse_counters(metrics(5)))
    assert not result.passed
    assert (
        result.reason == "kvfence_kv_tag_mismatch_total on decode http://d rose by 3 during the run"
    )


def test_the_backends_whose_isolation_counters_rose_are_implicated_in_the_termination_message(
    tmp_path,
) -> None:
    """What the operator quarantines (spec.canary.onFailure Quarantine) comes from here: the
    summary's line, then the backends whose counters rose, never those that only moved."""
    rose = check_engine_counters(parse_counters(metrics(2)), parse_counters(metrics(5)))
    assert rose.inputs["implicated"] == ["http://d"]
    late = check_engine_counters(parse_counters(metrics()), parse_counters(metrics(late=1)))
    assert late.inputs["implicated"] == []
    report = CanaryReport(
        "http://router", "fail", 1, rose.reason, True, "2026-12-07T12:00:00Z", 1.0, 9, 1, None,
        None, [rose, late], [],
    )  # fmt: skip
    log = tmp_path / "termination-log"
    log.touch()
    assert write_termination_message(report, str(log))
    summary, implicated = log.read_text().split("\n")
    assert summary == report.summary
    assert implicated == f"{IMPLICATED_BACKENDS} http://d"


def test_engine_counters_report_dropped_late_writes_without_failing() -> None:
    result = check_engine_counters(parse_counters(metrics()), parse_counters(metrics(late=1)))
    assert result.passed
    assert result.inputs["moved"] == {"kvfence_late_writes_dropped_total decode http://d": 1.0}


def test_engine_counters_that_cannot_be_read_could_not_run_and_a_reset_fails() -> None:
    """Issue 34: an unreadable counter was printed FAIL, a finding, though nothing was judged.
    It is "could not run": never a pass, and no finding (exit 2, which the operator retries)."""
    down = check_engine_counters(parse_counters(metrics()), parse_counters(metrics(up=0)))
    assert down.verdict == "could not run" and not down.passed and down.findings == []
    assert down.reason == "could not read the counters of decode http://d (after the run)"
    bare = parse_counters("# TYPE other_total counter\nother_total 1\n")
    missing = check_engine_counters(bare, bare)
    assert missing.verdict == "could not run"
    assert "exposes no kvfence_kv_tag_mismatch_total (before the run)" in missing.reason
    assert check_engine_counters(None, None).verdict == "could not run"
    reset = check_engine_counters(parse_counters(metrics(3)), parse_counters(metrics(0)))
    assert reset.verdict == "fail" and "restarted" in reset.reason
    # a rise is a finding even where another engine could not be read
    rose = check_engine_counters(parse_counters(metrics(0)), parse_counters(metrics(1, up=0)))
    assert rose.verdict == "fail" and "rose by 1" in rose.reason


def test_an_engines_own_metrics_read_like_the_routers_re_export() -> None:
    text = "# TYPE kvfence_kv_tag_mismatch_total counter\nkvfence_kv_tag_mismatch_total 4.0\n"
    assert parse_counters(text).values == {("kvfence_kv_tag_mismatch", "the target"): 4.0}


# --- the plan ----------------------------------------------------------------------------


def test_probes_straddle_the_limit_and_the_pool_longest_first() -> None:
    probes = boundary_probes(512, 512, 512, 1024, 8)
    assert [p.length for p in probes] == [1025, 1024, 1023, 513, 512, 128]
    assert [p.within_limit for p in probes] == [False] * 4 + [True] * 2
    assert probes[1].why == "2 x context, pool"
    assert probes[4].max_tokens == 1 and probes[5].max_tokens == 8  # room left in the context
    long = boundary_probes(4096, 4096, 4096, 8192, 8)
    assert 4096 - 1000 in [p.length for p in long]


def test_an_engine_limit_below_the_advertised_context_is_what_the_probes_hold_to() -> None:
    # the router advertises 1024 while its engines serve 128: 1024 must be refused too
    probes = {p.length: p for p in boundary_probes(128, 1024, 1024, 1024, 8)}
    assert not probes[129].within_limit and not probes[1024].within_limit
    assert "advertised context" in probes[1024].why and 1025 in probes


def test_prompts_have_exact_lengths_and_replay_identically() -> None:
    assert len(token_prompt(7, "x", 1000)) == 1000
    assert token_prompt(7, "x", 50) == token_prompt(7, "x", 50) != token_prompt(8, "x", 50)


def test_a_pollution_burst_fills_the_pool_page_for_page() -> None:
    assert pollution_lengths(1024, 430, 16, 32) == [430, 430, 160]  # 27 + 27 + 10 pages
    assert pollution_lengths(1024, 430, 16, 1) == [430]
    probe = concurrent_probe(512, 16, 500)
    assert probe.length == 33 and probe.max_tokens == 480  # limited by the room left


def test_a_routers_pool_summary_lists_every_engine() -> None:
    summary = {
        "backends": [
            {"role": "prefill", "url": "p", "report": {"pool_tokens": 2048, "page_size": 16,
                                                      "context_length_effective": 512}},
            {"role": "decode", "url": "d", "report": {"pool_tokens": 1024, "page_size": 16,
                                                     "context_length_effective": 512}},
            {"role": "decode", "url": "gone", "error": "unreachable or not ready"},
        ]
    }  # fmt: skip
    engines, unreachable = parse_pools(summary)
    assert [e.pool_tokens for e in engines] == [2048, 1024] and unreachable == ("decode gone",)


# --- report and exit codes ---------------------------------------------------------------


def failed_check() -> CheckResult:
    return CheckResult("status_codes", False, "over-limit-513 was answered 200", {}, ["x"])


def not_run_check() -> CheckResult:
    return check_engine_counters(None, None, "/metrics answered 403: it needs the internal token")


def test_a_check_that_could_not_run_leaves_the_run_without_a_verdict_but_hides_no_finding() -> None:
    ok = CheckResult("marker", True, "fine", {})
    assert decide([ok, not_run_check()], None, 1.0, 10) == (
        "error",
        2,
        "could not run 1 of 2 checks: engine_counters: the target's /metrics could not be read "
        "(/metrics answered 403: it needs the internal token)",
    )
    assert decide([not_run_check(), failed_check()], None, 1.0, 10)[:2] == ("fail", 1)
    assert decide([not_run_check()], "timed out after 5s", 5.0, 10)[:2] == ("error", 2)
    report = CanaryReport(
        "http://t", "error", 2, "could not run 1 of 1 checks: x", True, "now", 1.0, 10, 1,
        None, None, [not_run_check()], [],
    )  # fmt: skip
    lines = report.human().splitlines()
    assert lines[1].startswith("  COULD NOT RUN engine_counters ")
    assert lines[-1] == "  no verdict: could not run 1 of 1 checks: x"


def test_the_default_timeout_is_what_the_operator_gives_its_canary() -> None:
    """300 s timed out where `kvfence up`'s own canary had 600 (issue 34): the CLI's default is
    spec.canary.timeoutSeconds' default; against a local `up`, that `up`'s own value."""
    from kvfence_engine.canary.config import DEFAULT_TIMEOUT
    from kvfence_operator.crd.types import CanarySpec

    assert (
        DEFAULT_TIMEOUT
        == CanarySpec().timeout_seconds
        == CanaryConfig("http://t", "a", "b").timeout
    )


def test_exit_codes_pass_fail_and_could_not_run() -> None:
    ok = CheckResult("marker", True, "fine", {})
    assert decide([ok], None, 1.0, 10)[:2] == ("pass", 0)
    assert decide([ok, failed_check()], None, 1.0, 10) == (
        "fail",
        1,
        "status_codes: over-limit-513 was answered 200",
    )
    assert decide([ok], "timed out after 5s", 5.0, 10) == ("error", 2, "timed out after 5s")
    # a violation seen before the run stopped is a finding: exit 1, not "could not run" (which
    # the operator's canary Job retries and reports as CanaryCouldNotRun)
    outcome, code, reason = decide([failed_check()], "timed out after 5s", 5.0, 10)
    assert (outcome, code) == ("fail", 1)
    assert reason == (
        "status_codes: over-limit-513 was answered 200 (then the run stopped: timed out after 5s)"
    )


def sample_report(reason: str = "status_codes: over-limit-513 was answered 200") -> CanaryReport:
    return CanaryReport(
        "http://t", "fail", 1, reason, True, "now", 1.0, 10, 1, None, None, [failed_check()], []
    )


def test_report_file_is_json_but_the_termination_log_gets_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = sample_report()
    path = tmp_path / "report.json"
    report_module.write_report(report, str(path))
    assert json.loads(path.read_text())["checks"][0]["name"] == "status_codes"
    log = tmp_path / "termination-log"
    monkeypatch.setattr(report_module, "TERMINATION_LOG", str(log))
    report_module.write_report(report, str(log))
    assert log.read_text() == "kvfence canary FAIL: status_codes: over-limit-513 was answered 200"


def test_termination_message_only_where_a_termination_log_exists(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    assert not report_module.write_termination_message(sample_report(), str(log))
    log.touch()
    assert report_module.write_termination_message(sample_report("x" * 9000), str(log))
    assert len(log.read_bytes()) <= report_module.TERMINATION_LIMIT


def test_bad_configuration_is_refused_with_exit_code_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="different keys"):
        CanaryConfig("http://t", "same", "same")
    code = main(["canary", "--target", "http://t", "--tenant-a-key", "k", "--tenant-b-key", "k"])
    assert code == 2 and "different keys" in capsys.readouterr().err


def test_callers_are_told_each_step_and_a_down_target_is_exit_code_2() -> None:
    steps: list[str] = []
    url = f"http://127.0.0.1:{free_port()}"
    report = run_canary(CanaryConfig(url, "a", "b", progress=steps.append))
    assert steps == ["discovering the target"]
    assert report.exit_code == 2 and report.summary.startswith("kvfence canary ERROR: could not")


# --- the router's /metrics needs the internal token ---------------------------------------


def metrics_behind_a_token(request: httpx.Request) -> httpx.Response:
    """A router's /metrics that answers only its internal token, as a real router with keys
    and a token does (a tenant's key gets 403)."""
    if request.headers.get(TOKEN_HEADER) == "tok":
        return httpx.Response(200, text=metrics())
    return httpx.Response(403, json={"error": {"message": "no", "type": "permission_error"}})


@pytest.mark.parametrize("token", ["tok", None])
def test_the_canary_reads_the_routers_metrics_with_the_token_and_says_why_not_without(
    token: str | None,
) -> None:
    notices: list[str] = []
    config = CanaryConfig(
        "http://router", "key-a", "key-b", internal_token=token, notice=notices.append
    )
    run = CanaryRun(config, seed=1)
    run.target.http = httpx.AsyncClient(transport=httpx.MockTransport(metrics_behind_a_token))
    run.before = asyncio.run(run.read_counters())
    run.say_if_counters_cannot_be_judged()
    if token is not None:
        assert run.before is not None and run.counters_unread is None and notices == []
        return
    assert run.before is None
    result = check_engine_counters(None, None, run.counters_unread)
    assert result.verdict == "could not run"  # as any unreadable /metrics: no verdict
    assert "needs the internal token (--internal-token-file)" in result.reason
    # said when learnt, at the first reading, not at the end of a run of many minutes
    (notice,) = notices
    assert notice.startswith(
        "engine_counters could not run: /metrics answered 403: it needs the internal token "
        "(--internal-token-file). "
    )
    assert "ends 'could not run' (exit 2) at best" in notice
