"""The pool check's decisions, from /v1/kvpool answers to readiness gates and served context."""

import httpx
import pytest

from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.tools import http_clients
from kvfence_operator.cluster.prober import read_pool
from kvfence_operator.crd.types import PoolPolicy
from kvfence_operator.decisions.pool_gate import PodPool, judge_pools, parse_pool


def report(pool_tokens: int, role: str = "decode", revision: str = "r1", **extra) -> dict:
    return {
        "role": role,
        "revision": revision,
        "pool_tokens": pool_tokens,
        "page_size": 16,
        "num_pages": pool_tokens // 16,
        "free_pages": pool_tokens // 16,
        "context_length_effective": 1024,
        "tag_check": True,
        "deferred_release": True,
        **extra,
    }


def pod(name: str, pool_tokens: int, role: str = "decode", **extra) -> PodPool:
    return parse_pool(name, role, "r1", report(pool_tokens, role, **extra))


def test_refuse_opens_the_gate_only_for_pods_whose_pool_holds_the_context():
    decision = judge_pools(
        [pod("p-0", 2048, "prefill"), pod("d-0", 1024), pod("d-1", 512)],
        PoolPolicy.REFUSE,
        context_length=1024,
        min_context_length=None,
    )
    assert {name: g.sufficient for name, g in decision.gates.items()} == {
        "p-0": True,
        "d-0": True,
        "d-1": False,
    }
    assert not decision.sufficient
    assert decision.reason == "PoolTooSmall"
    assert "d-1" in decision.message and "512" in decision.message and "1024" in decision.message
    assert decision.min_pool_tokens == 512


def test_lower_context_serves_the_smallest_pool_rounded_down_to_a_page():
    decision = judge_pools(
        [pod("p-0", 4096, "prefill"), pod("d-0", 1000 // 16 * 16)],
        PoolPolicy.LOWER_CONTEXT,
        context_length=2048,
        min_context_length=512,
    )
    assert decision.sufficient
    assert decision.effective_context == 992
    assert all(g.sufficient for g in decision.gates.values())
    assert "lowered from 2048" in decision.message


def test_lower_context_never_serves_more_than_asked():
    decision = judge_pools(
        [pod("p-0", 8192, "prefill"), pod("d-0", 8192)], PoolPolicy.LOWER_CONTEXT, 2048, None
    )
    assert decision.effective_context == 2048


def test_lower_context_never_lowers_a_context_the_pool_holds():
    """A context that is not a whole number of pages is served as asked when every pool holds
    it: 1000 tokens with 16-token pages, in pools of 8192 (it was lowered to 992, and with
    minContextLength 1000 the pools were refused)."""
    pools = [pod("p-0", 8192, "prefill"), pod("d-0", 8192)]
    served = judge_pools(pools, PoolPolicy.LOWER_CONTEXT, 1000, None)
    assert served.sufficient and served.effective_context == 1000
    floored = judge_pools(pools, PoolPolicy.LOWER_CONTEXT, 1000, 1000)
    assert floored.sufficient and floored.effective_context == 1000
    # a pool smaller than the context still serves whole pages of it
    lowered = judge_pools([pod("d-0", 1000 // 16 * 16)], PoolPolicy.LOWER_CONTEXT, 1000, None)
    assert lowered.effective_context == 992


def test_lower_context_below_min_context_length_refuses_every_pod():
    decision = judge_pools(
        [pod("p-0", 4096, "prefill"), pod("d-0", 256)], PoolPolicy.LOWER_CONTEXT, 2048, 512
    )
    assert not decision.sufficient
    assert decision.effective_context is None
    assert not any(g.sufficient for g in decision.gates.values())
    assert "minContextLength 512" in decision.message


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ("not json at all", "malformed"),
        ({"role": "decode"}, "malformed"),
        (report(-16), "malformed"),
        ({**report(1024), "num_pages": 3}, "num_pages"),
        (report(1024, role="prefill"), "expected 'decode'"),
        (report(1024, revision="other"), "revision 'other'"),
    ],
)
def test_a_garbage_pool_report_counts_as_not_sufficient_with_a_clear_message(payload, needle):
    decision = judge_pools(
        [parse_pool("d-0", "decode", "r1", payload)], PoolPolicy.REFUSE, 512, None
    )
    gate = decision.gates["d-0"]
    assert not gate.sufficient and gate.reason == "PoolUnknown"
    assert needle in gate.message
    assert not decision.sufficient


def test_an_engine_with_its_tag_check_off_is_never_sufficient():
    decision = judge_pools([pod("d-0", 4096, tag_check=False)], PoolPolicy.REFUSE, 512, None)
    assert not decision.gates["d-0"].sufficient
    assert "tag check is off" in decision.gates["d-0"].message


@pytest.mark.parametrize("fault", ["early-release", "late-write", "skip-count-check"])
def test_an_engine_reporting_any_unsafe_fault_is_never_sufficient(fault):
    """Issue 12, finding 7: only the tag check and deferred release were looked at, so an
    engine whose defences report on but that runs another fault passed the gate."""
    for policy in PoolPolicy:
        decision = judge_pools(
            [pod("d-0", 4096, unsafe_faults=[fault]), pod("p-0", 4096, "prefill")],
            policy,
            512,
            None,
        )
        gate = decision.gates["d-0"]
        assert not gate.sufficient and gate.reason == "IsolationDefenceOff"
        assert f"unsafe faults ({fault})" in gate.message
        assert not decision.sufficient and decision.reason == "IsolationDefenceOff"
        assert decision.gates["p-0"].sufficient  # the control: the same pod without the fault


def test_a_tests_operator_may_let_unsafe_faults_through_but_nothing_else():
    """KVFENCE_ALLOW_UNSAFE=1 on the operator: a test can watch the canary catch a fault. The
    other defences still close the gate."""
    faulty = pod("d-0", 4096, unsafe_faults=["early-release"])
    tagless = pod("d-1", 4096, unsafe_faults=["no-tag-check"], tag_check=False)
    decision = judge_pools(
        [faulty, tagless], PoolPolicy.REFUSE, 512, None, unsafe_faults_allowed=True
    )
    assert decision.gates["d-0"].sufficient
    assert not decision.gates["d-1"].sufficient
    assert "tag check is off" in decision.gates["d-1"].message


def test_an_unreachable_pod_counts_as_not_sufficient():
    unreachable = read_pool("d-0", "decode", "r1", "http://127.0.0.1:9")  # discard port
    assert unreachable.report is None and "unreachable" in (unreachable.error or "")
    no_ip = read_pool("d-1", "decode", "r1", None)
    decision = judge_pools(
        [unreachable, no_ip, pod("p-0", 4096, "prefill")], PoolPolicy.REFUSE, 512, None
    )
    assert not decision.sufficient
    assert not decision.gates["d-0"].sufficient and not decision.gates["d-1"].sufficient
    assert decision.gates["p-0"].sufficient


def test_read_pool_reports_an_error_status_and_non_json(monkeypatch):
    def answer(status: int, text: str):
        return lambda url, timeout, headers: httpx.Response(
            status, text=text, request=httpx.Request("GET", url)
        )

    monkeypatch.setattr(http_clients, "get", answer(500, "boom"))
    assert "answered 500" in (read_pool("d", "decode", "r1", "http://x").error or "")
    monkeypatch.setattr(http_clients, "get", answer(200, "<html>"))
    assert "non-JSON" in (read_pool("d", "decode", "r1", "http://x").error or "")


def test_no_engine_pods_is_not_sufficient():
    decision = judge_pools([], PoolPolicy.REFUSE, 512, None)
    assert not decision.sufficient and decision.reason == "NoEnginePods"


def test_read_pool_presents_the_revisions_internal_token(monkeypatch):
    """An engine with a token refuses its /v1/kvpool without it: the probe must carry it."""
    token = "t" * 40
    report = pod("d-0", 4096).report
    assert report is not None

    def engine(url: str, timeout: float, headers: dict[str, str]) -> httpx.Response:
        status = 200 if headers.get(TOKEN_HEADER) == token else 401
        return httpx.Response(
            status, json=report.model_dump(mode="json"), request=httpx.Request("GET", url)
        )

    monkeypatch.setattr(http_clients, "get", engine)
    assert read_pool("d-0", "decode", "r1", "http://x", token).report == report
    refused = read_pool("d-0", "decode", "r1", "http://x")  # the control: no token, no report
    assert refused.report is None and "answered 401" in (refused.error or "")


def test_a_tenant_share_of_the_pool_must_hold_the_context_since_a_request_is_one_tenants():
    """With maxPoolSharePerTenant, one tenant's full-context request can use only its share:
    a pool that holds the context whole but not in a share would refuse every such request
    (the canary's full-context probe too) while the gate said it was sufficient."""
    pools = [pod("p-0", 4096, "prefill"), pod("d-0", 4096)]
    whole = judge_pools(pools, PoolPolicy.REFUSE, context_length=2048, min_context_length=None)
    assert whole.sufficient
    shared = judge_pools(
        pools, PoolPolicy.REFUSE, context_length=2048, min_context_length=None, pool_share=0.25
    )
    assert not shared.sufficient and shared.reason == "PoolTooSmall"
    assert "a tenant's share 0.25 of it holds 1024 tokens, smaller than contextLength 2048" in (
        shared.message
    )
    lowered = judge_pools(
        pools, PoolPolicy.LOWER_CONTEXT, 2048, min_context_length=512, pool_share=0.25
    )
    assert lowered.sufficient and lowered.effective_context == 1024
    assert lowered.min_pool_tokens == 4096  # the status still shows the pools themselves
    no_cap = judge_pools(pools, PoolPolicy.REFUSE, 2048, None, pool_share=1.0)
    assert no_cap.sufficient


def test_a_refusal_names_each_small_pod_once_and_the_remedy_once():
    decision = judge_pools(
        [pod("p-0", 672, "prefill"), pod("d-0", 672)],
        PoolPolicy.REFUSE,
        context_length=1024,
        min_context_length=None,
    )
    assert decision.message == (
        "pod p-0 (prefill) has a KV pool of 672 tokens, smaller than contextLength 1024; "
        "pod d-0 (decode) has a KV pool of 672 tokens, smaller than contextLength 1024; "
        "raise kvCacheMemory by 53% or lower contextLength to 672"
    )
    # each pod's own gate carries the remedy too (its readiness gate condition shows it alone)
    assert decision.gates["d-0"].message == (
        "pod d-0 (decode) has a KV pool of 672 tokens, smaller than contextLength 1024; "
        "raise kvCacheMemory by 53% or lower contextLength to 672"
    )


def test_lower_context_below_the_floor_names_the_smallest_pod_and_the_remedy():
    decision = judge_pools(
        [pod("p-0", 4096, "prefill"), pod("d-0", 672), pod("d-1", 672)],
        PoolPolicy.LOWER_CONTEXT,
        context_length=2048,
        min_context_length=1024,
    )
    assert not decision.sufficient
    assert decision.message == (
        "the smallest KV pool (pod d-0 (decode), 672 tokens) is below minContextLength 1024; "
        "raise kvCacheMemory by 53% or lower minContextLength to 672"
    )


def test_the_remedy_is_the_arithmetic_preflight_shows():
    """1456 tokens of pool for a context of 2048: preflight says 41% (docs/engine.md)."""
    decision = judge_pools(
        [pod("d-0", 1456)], PoolPolicy.REFUSE, context_length=2048, min_context_length=None
    )
    assert "raise kvCacheMemory by 41% or lower contextLength to 1456" in decision.message


def test_a_held_gate_stands_without_a_report_at_the_context_it_was_given():
    """pods.gate_held: a new operator that has not read a serving pod's pool yet."""
    unread = PodPool("d-0", "decode", "r1", error="probing")
    pools = [pod("p-0", 4096, "prefill"), unread]
    refuse = judge_pools(pools, PoolPolicy.REFUSE, 1024, None, held=frozenset({"d-0"}))
    assert refuse.sufficient and refuse.gates["d-0"].sufficient
    lower = judge_pools(
        pools, PoolPolicy.LOWER_CONTEXT, 2048, None, held=frozenset({"d-0"}), held_context=1024
    )
    assert lower.sufficient and lower.effective_context == 1024  # not the reported 2048
    # with no context the routers were given, a held pod is unknown like any unread one
    blind = judge_pools(pools, PoolPolicy.LOWER_CONTEXT, 2048, None, held=frozenset({"d-0"}))
    assert not blind.sufficient and blind.gates["d-0"].reason == "PoolUnknown"
    assert not judge_pools(pools, PoolPolicy.REFUSE, 1024, None).gates["d-0"].sufficient
