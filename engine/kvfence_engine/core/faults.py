"""Test-only fault switches that re-create each known KV isolation bug class.

They exist so tests and the canary can prove they catch the bug. A default deployment can
never reach them: asking for one without KVFENCE_ALLOW_UNSAFE=1 is an error at start-up.
"""

import os
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

ALLOW_ENV = "KVFENCE_ALLOW_UNSAFE"


class Fault(StrEnum):
    """One bug class; the value is its `--unsafe-fault` name."""

    description: str

    def __new__(cls, name: str, description: str) -> "Fault":
        member = str.__new__(cls, name)
        member._value_ = name
        member.description = description
        return member

    NO_TAG_CHECK = "no-tag-check", "attention reads pages without checking their tag and fill"
    REJECT_PLACEHOLDER = (
        "reject-placeholder",
        "an over-long prompt becomes a one-token placeholder whose rejection is stored where "
        "the admission check does not look; the full length is reserved and read",
    )
    EARLY_RELEASE = (
        "early-release",
        "a request's first page is returned to the free list while still in use",
    )
    LATE_WRITE = (
        "late-write",
        "an aborted request's in-flight transfer write is applied without a tag check",
    )
    SKIP_COUNT_CHECK = (
        "skip-count-check",
        "decode does not compare tokens written with tokens reserved",
    )
    CROSS_TENANT_PREFIX = (
        "cross-tenant-prefix",
        "the prefix cache's page keys leave the tenant out, so one tenant's lookup finds "
        "another's cached pages",
    )


class UnsafeFaultRefused(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Faults:
    enabled: frozenset[Fault] = frozenset()

    def __contains__(self, fault: object) -> bool:
        # A bare string would let a typo ("late-wirte") quietly switch a check off.
        if not isinstance(fault, Fault):
            raise TypeError(f"ask Faults about a Fault member, not {fault!r}")
        return fault in self.enabled

    @classmethod
    def from_names(cls, names: Iterable[str], environ: dict[str, str] | None = None) -> "Faults":
        names = frozenset(names)
        if not names:
            return cls()
        known = {fault.value: fault for fault in Fault}
        unknown = sorted(names - known.keys())
        if unknown:
            raise UnsafeFaultRefused(
                f"unknown --unsafe-fault {', '.join(unknown)}; known: {', '.join(Fault)}"
            )
        env = os.environ if environ is None else environ
        if env.get(ALLOW_ENV) != "1":
            raise UnsafeFaultRefused(
                f"--unsafe-fault {', '.join(sorted(names))} re-creates a KV isolation bug and is "
                f"for tests only; it is refused unless {ALLOW_ENV}=1"
            )
        return cls(frozenset(known[name] for name in names))
