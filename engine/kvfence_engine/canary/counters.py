"""The engines' isolation counters, read from Prometheus text: an engine's own series, or the
router's per-backend re-export of them (kvfence_backend_*{role, backend})."""

from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvfence_engine.core.metrics import BACKEND_PREFIX, ISOLATION_COUNTERS

# A rise in any of these means a defence caught a request reading or receiving KV it does not
# own: the revision is not safe, even though the defence failed that request closed.
MUST_NOT_RISE = (
    "kvfence_kv_tag_mismatch",
    "kvfence_kv_unwritten_read",
    "kvfence_transfer_checksum_failed",
    "kvfence_transfer_count_mismatch",
    "kvfence_kv_foreign_tenant_read",
)
# Engines older than the prefix cache do not export this one: its absence is no finding (a
# rise, where it is exported, is).
NOT_EXPORTED_BY_ALL = ("kvfence_kv_foreign_tenant_read",)
# Reported, not failed: a dropped late write is the defence working on a transfer that outlived
# its request, which a canary's own traffic through a correct router never causes.
INFORMATIONAL = tuple(c for c in ISOLATION_COUNTERS if c not in MUST_NOT_RISE)

Series = tuple[str, str]  # (counter family as the engine names it, where: "decode http://...")


@dataclass(frozen=True, slots=True)
class CounterSnapshot:
    values: dict[Series, float] = field(default_factory=dict)
    unreadable: tuple[str, ...] = ()  # backends whose /metrics the router could not read

    def counters(self) -> set[str]:
        return {counter for counter, _ in self.values}

    def as_dict(self) -> dict[str, Any]:
        return {
            "values": [
                {"counter": c, "source": s, "value": v} for (c, s), v in self.values.items()
            ],
            "unreadable": list(self.unreadable),
        }


def parse_counters(text: str) -> CounterSnapshot:
    values: dict[Series, float] = {}
    unreadable: list[str] = []
    for family in text_string_to_metric_families(text):
        if family.name == BACKEND_PREFIX + "up":
            unreadable += [_source(s.labels) for s in family.samples if s.value != 1.0]
            continue
        counter = _engine_name(family.name)
        if counter not in ISOLATION_COUNTERS:
            continue
        for sample in family.samples:
            if sample.name == family.name + "_total":
                values[(counter, _source(sample.labels))] = sample.value
    return CounterSnapshot(values, tuple(unreadable))


def _engine_name(name: str) -> str:
    if name.startswith(BACKEND_PREFIX):
        return "kvfence_" + name.removeprefix(BACKEND_PREFIX)
    return name


def _source(labels: dict[str, str]) -> str:
    return f"{labels.get('role', '')} {labels.get('backend', '')}".strip() or "the target"


def unreadable_reasons(snapshot: CounterSnapshot) -> list[str]:
    """Why this snapshot cannot judge every engine: a backend whose /metrics the router could
    not read, a counter that must not rise but is not exported. Known from the first snapshot,
    before the run sends a probe; check_engine_counters cannot run with any."""
    reasons = [f"could not read the counters of {source}" for source in snapshot.unreadable]
    reasons += [
        f"the target exposes no {counter}_total"
        for counter in MUST_NOT_RISE
        if counter not in NOT_EXPORTED_BY_ALL and counter not in snapshot.counters()
    ]
    return reasons
