"""Test-only fault switches that re-create each known KV isolation bug class.

They exist so tests and the canary can prove they catch the bug. A default deployment can
never reach them: asking for one without KVFENCE_ALLOW_UNSAFE=1 is an error at start-up.
"""

import os
from collections.abc import Iterable
from dataclasses import dataclass

ALLOW_ENV = "KVFENCE_ALLOW_UNSAFE"

FAULTS: dict[str, str] = {
    "no-tag-check": "attention reads pages without checking their tag and fill",
    "reject-placeholder": (
        "an over-long prompt becomes a one-token placeholder whose rejection is stored where "
        "the admission check does not look; the full length is reserved and read"
    ),
    "early-release": "a request's first page is returned to the free list while still in use",
    "late-write": "an aborted request's in-flight transfer write is applied without a tag check",
    "skip-count-check": "decode does not compare tokens written with tokens reserved",
}


class UnsafeFaultRefused(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Faults:
    enabled: frozenset[str] = frozenset()

    def __contains__(self, name: str) -> bool:
        return name in self.enabled

    @classmethod
    def from_names(cls, names: Iterable[str], environ: dict[str, str] | None = None) -> "Faults":
        names = frozenset(names)
        if not names:
            return cls()
        unknown = sorted(names - FAULTS.keys())
        if unknown:
            raise UnsafeFaultRefused(
                f"unknown --unsafe-fault {', '.join(unknown)}; known: {', '.join(FAULTS)}"
            )
        env = os.environ if environ is None else environ
        if env.get(ALLOW_ENV) != "1":
            raise UnsafeFaultRefused(
                f"--unsafe-fault {', '.join(sorted(names))} re-creates a KV isolation bug and is "
                f"for tests only; it is refused unless {ALLOW_ENV}=1"
            )
        return cls(names)
