"""The pool check: what each engine pod's real KV pool (its /v1/kvpool report) lets it serve.

`judge_pools` is a pure function the kopf handlers and `kvfence up` share, so both make the
same decision from the same numbers; the reading is cluster/prober.py::read_pool.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from kvfence_engine.contracts import PoolGateReport
from kvfence_engine.core.pool_plan import (
    ContextPolicy,
    budget_raise_percent,
    effective_context,
    tenant_share_pages,
)
from kvfence_operator.crd.types import ConditionReason, PoolPolicy


@dataclass(frozen=True, slots=True)
class PodPool:
    """One engine pod as the probe saw it: a valid report, or why there is none."""

    pod: str
    role: str
    revision: str
    report: PoolGateReport | None = None
    error: str | None = None


def parse_pool(pod: str, role: str, revision: str, payload: object) -> PodPool:
    """Garbage, or a report about another role or revision, counts as no report."""
    try:
        report = PoolGateReport.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return PodPool(pod, role, revision, error=f"malformed /v1/kvpool ({where}: {first['msg']})")
    if report.role != role or report.revision != revision:
        return PodPool(
            pod,
            role,
            revision,
            error=f"/v1/kvpool reports role {str(report.role)!r} revision {report.revision!r}, "
            f"expected {role!r} {revision!r}",
        )
    return PodPool(pod, role, revision, report=report)


@dataclass(frozen=True, slots=True)
class Remedy:
    """What would let a pool serve what it refused: the same arithmetic as `kvfence preflight`
    (a larger kvCacheMemory), or asking for what the pool holds (`fits` tokens)."""

    raise_percent: int | None  # None: the pool is empty, no percentage of it says how much
    lowerable: str  # the spec field to lower instead: contextLength or minContextLength
    fits: int

    def __str__(self) -> str:
        grow = "raise kvCacheMemory" + (
            f" by {self.raise_percent}%" if self.raise_percent is not None else ""
        )
        return f"{grow} or lower {self.lowerable} to {self.fits}" if self.fits > 0 else grow


@dataclass(frozen=True, slots=True)
class PodGate:
    """The value of one pod's kvfence.dev/kv-pool readiness gate, with the reason: `finding`
    says what is wrong (or right) with this pod, `remedy` what would change it."""

    pod: str
    sufficient: bool
    reason: ConditionReason
    finding: str
    remedy: Remedy | None = None

    @property
    def message(self) -> str:
        return f"{self.finding}; {self.remedy}" if self.remedy else self.finding


@dataclass(frozen=True, slots=True)
class PoolDecision:
    gates: dict[str, PodGate]
    sufficient: bool  # every pod may serve the effective context
    effective_context: int | None  # what the router serves; None when nothing can be served
    min_pool_tokens: int | None
    reason: ConditionReason
    message: str

    @property
    def refused(self) -> bool:
        """A verdict waiting will not change: every pod reported, and a pool cannot serve."""
        return (
            not self.sufficient
            and bool(self.gates)
            and all(g.reason != ConditionReason.POOL_UNKNOWN for g in self.gates.values())
        )


def _defences_off(report: PoolGateReport, unsafe_faults_allowed: bool) -> str | None:
    if not report.tag_check:
        return "its KV tag check is off"
    if not report.deferred_release:
        return "it releases KV pages before inbound transfers drain"
    if report.unsafe_faults and not unsafe_faults_allowed:
        return f"it runs with unsafe faults ({', '.join(sorted(report.unsafe_faults))})"
    return None


def judge_pools(
    pools: Sequence[PodPool],
    policy: PoolPolicy,
    context_length: int,
    min_context_length: int | None,
    *,
    unsafe_faults_allowed: bool = False,
    pool_share: float | None = None,
    held: frozenset[str] = frozenset(),
    held_context: int | None = None,
) -> PoolDecision:
    """Refuse: a pod may serve only if its pool holds `context_length`. LowerContext: the
    served context is the smallest pool (whole pages, at most `context_length`); below
    `min_context_length` (default: one page) nothing is served. A pod without a valid report,
    or with an isolation defence off (its tag check, deferred release, or any unsafe fault),
    is never sufficient. `unsafe_faults_allowed` (the operator under KVFENCE_ALLOW_UNSAFE=1,
    for tests whose canary must catch a fault) lets a pod's faults through; nothing else.
    `pool_share` (spec.tenantLimits.maxPoolSharePerTenant): a request is one tenant's, so what
    must hold the context is one tenant's share of each pool, not the whole pool.
    `held`: pods without a report whose True gate stands (pods.gate_held), judged before at
    `held_context` (the routers' served context then); under LowerContext the served context
    is at most that, and without it they are unknown like any pod without a report."""
    gates: dict[str, PodGate] = {}
    reports: dict[str, PoolGateReport] = {}
    if policy is PoolPolicy.LOWER_CONTEXT and held_context is None:
        held = frozenset()
    for pool in pools:
        if pool.report is None and pool.pod in held:
            gates[pool.pod] = PodGate(
                pool.pod,
                True,
                ConditionReason.POOL_HOLDS_CONTEXT,
                f"pod {pool.pod}: judged before and its engine runs on; not read again yet",
            )
            continue
        if pool.report is None:
            gates[pool.pod] = PodGate(
                pool.pod,
                False,
                ConditionReason.POOL_UNKNOWN,
                f"pod {pool.pod}: {pool.error or 'no report'}",
            )
            continue
        weak = _defences_off(pool.report, unsafe_faults_allowed)
        if weak is not None:
            gates[pool.pod] = PodGate(
                pool.pod, False, ConditionReason.ISOLATION_DEFENCE_OFF, f"{pool.pod}: {weak}"
            )
            continue
        reports[pool.pod] = pool.report
    min_pool = min((r.pool_tokens for r in reports.values()), default=None)
    usable = {pod: _tenant_pool(r, pool_share) for pod, r in reports.items()}
    min_usable = min(usable.values(), default=None)

    def share_note(pod: str) -> str:
        if not _shared(pool_share):
            return ""
        return f"; a tenant's share {pool_share:g} of it holds {usable[pod]} tokens"

    if policy is PoolPolicy.REFUSE:
        effective: int | None = context_length
        for pod, report in reports.items():
            if usable[pod] >= context_length:
                gates[pod] = PodGate(
                    pod, True, ConditionReason.POOL_HOLDS_CONTEXT, _holds(pod, report)
                )
            else:
                gates[pod] = PodGate(
                    pod,
                    False,
                    ConditionReason.POOL_TOO_SMALL,
                    f"pod {pod} ({report.role}) has a KV pool of {report.pool_tokens} tokens"
                    f"{share_note(pod)}, smaller than contextLength {context_length}",
                    _remedy(usable[pod], context_length, report.page_size, "contextLength"),
                )
    else:
        floor = min_context_length or 1
        smallest_share = (
            f"; a tenant's share of it holds {min_usable}" if _shared(pool_share) else ""
        )
        page = max((r.page_size for r in reports.values()), default=1)
        served = [
            *([effective_context(context_length, min_usable, page, ContextPolicy.LOWER)]
              if min_usable is not None else []),
            *([held_context] if held and held_context is not None else []),
        ]  # fmt: skip
        effective = min(served) if served and min(served) >= floor else None
        smallest = min(usable, key=lambda pod: usable[pod], default=None)
        for pod, report in reports.items():
            if effective is None:
                assert smallest is not None and min_usable is not None
                gates[pod] = PodGate(
                    pod,
                    False,
                    ConditionReason.POOL_TOO_SMALL,
                    f"the smallest KV pool (pod {smallest} ({reports[smallest].role}), "
                    f"{reports[smallest].pool_tokens} tokens{smallest_share}) is below "
                    f"minContextLength {floor}",
                    _remedy(min_usable, floor, page, "minContextLength"),
                )
            else:
                gates[pod] = PodGate(
                    pod, True, ConditionReason.POOL_HOLDS_CONTEXT, _holds(pod, report, effective)
                )

    insufficient = [g for g in gates.values() if not g.sufficient]
    if not pools:
        return PoolDecision(
            gates, False, None, None, ConditionReason.NO_ENGINE_PODS, "no engine pods yet"
        )
    if insufficient:
        return PoolDecision(
            gates,
            False,
            effective if policy is PoolPolicy.LOWER_CONTEXT else None,
            min_pool,
            insufficient[0].reason,
            _refusal(insufficient),
        )
    lowered_note = (
        f" (lowered from {context_length})"
        if effective is not None and effective < context_length
        else ""
    )
    return PoolDecision(
        gates,
        True,
        effective,
        min_pool,
        ConditionReason.POOLS_HOLD_CONTEXT,
        f"every engine pool holds the served context {effective}{lowered_note}; "
        f"smallest pool {min_pool} tokens",
    )


def _remedy(usable: int, needed: int, page_size: int, lowerable: str) -> Remedy:
    fits = usable // page_size * page_size
    return Remedy(budget_raise_percent(usable, needed, page_size), lowerable, fits)


def _refusal(insufficient: Sequence[PodGate]) -> str:
    """Each finding once (a LowerContext refusal is the same finding on every pod), then one
    remedy: the largest, which every refused pod's pool then meets."""
    findings = list(dict.fromkeys(g.finding for g in insufficient))
    remedies = [g.remedy for g in insufficient if g.remedy is not None]
    worst = max(remedies, key=lambda r: r.raise_percent or 10**9, default=None)
    return "; ".join([*findings, str(worst)] if worst else findings)


def _shared(pool_share: float | None) -> bool:
    return pool_share is not None and pool_share < 1.0


def _tenant_pool(report: PoolGateReport, pool_share: float | None) -> int:
    """The tokens one tenant's requests may hold in this pool."""
    if not _shared(pool_share):
        return report.pool_tokens
    assert pool_share is not None
    return tenant_share_pages(report.num_pages, pool_share) * report.page_size


def _holds(pod: str, report: PoolGateReport, context: int | None = None) -> str:
    served = f" the served context {context}" if context is not None else " the context"
    return f"pod {pod} has a KV pool of {report.pool_tokens} tokens, enough for{served}"
