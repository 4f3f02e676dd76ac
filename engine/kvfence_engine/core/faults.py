"""Test-only fault switches that re-create each known KV isolation bug class.

They exist so tests and the canary can prove they catch the bug. A default deployment can
never reach them: asking for one without KVFENCE_ALLOW_UNSAFE=1 is an error at start-up.
The hooks through which a fault acts on the pages are here too (below `Faults`).
"""

import os
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from kvfence_engine.core.request import Request, is_terminal

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
    SHARED_CACHE_EVICTION = (
        "shared-cache-eviction",
        "requests' allocations take the prefix cache's partition, evicting any tenant's least "
        "recently used cached page: the shared LRU in which one tenant counts another's pages",
    )
    RANK_DESYNC = (
        "rank-desync",
        "with tensor parallelism, the last rank stops following rank 0's page bookkeeping: its "
        "pool's tags no longer say who owns its part of each page",
    )


class UnsafeFaultRefused(ValueError):
    pass


# Faults whose hooks a running engine consults as it goes, so that one can be switched on in an
# engine that started healthy (POST /internal/unsafe-fault, refused unless KVFENCE_ALLOW_UNSAFE
# is 1): how a test shows the standing canary catching a revision that broke after its
# rollout canary passed. The others shape what the engine builds at start (the prefix cache's
# keys, the device decoder's read check, the pool's partition).
RUNTIME = frozenset({Fault.EARLY_RELEASE, Fault.LATE_WRITE, Fault.SKIP_COUNT_CHECK})


def runtime_fault(name: str, environ: dict[str, str] | None = None) -> Fault:
    """The fault a running engine is asked to switch on. PermissionError unless
    KVFENCE_ALLOW_UNSAFE=1; UnsafeFaultRefused for a name that is not one of RUNTIME."""
    env = os.environ if environ is None else environ
    if env.get(ALLOW_ENV) != "1":
        raise PermissionError(
            f"switching on an unsafe fault re-creates a KV isolation bug and is for tests only; "
            f"this engine was not started with {ALLOW_ENV}=1"
        )
    switchable = sorted(RUNTIME)
    fault = next((f for f in Fault if f.value == name), None)
    if fault not in RUNTIME:
        what = "unknown fault" if fault is None else "fault chosen at start-up (--unsafe-fault)"
        raise UnsafeFaultRefused(
            f"{name!r}: {what}; a running engine can switch on {', '.join(switchable)}"
        )
    assert fault is not None
    return fault


@dataclass(frozen=True, slots=True)
class Faults:
    enabled: frozenset[Fault] = frozenset()

    def with_(self, fault: Fault) -> "Faults":
        return Faults(self.enabled | {fault})

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


# --- the hooks: how a switched-on fault acts on the pages ------------------------------------
# The page bookkeeping (core/page_book) and its owner (core/page_manager) carry no fault branch
# of their own; each bug they can be made to show is written out here, where it is switched on.
# They reach the pages through the protocols below (the operator and the CLI's --help import
# this module, so it imports neither torch nor the modules that hold the pages).


class _Book(Protocol):
    def free_in_use(self, pages: list[int]) -> None: ...


class Pages(Protocol):
    """What a hook touches of the pages' owner (core/page_manager.py::PageManager)."""

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    @property
    def book(self) -> _Book: ...

    def write_page(self, page: int, tag: int, tokens: int, payload: memoryview) -> None: ...


class EarlyRelease:
    """early-release: a sibling owner hands a running request's first page back to the free
    list while the request still uses it. The next allocation by another owner gets it; the
    victim never does while any other page is free: the victim re-taking it would hide the
    fault, and whether it does would depend on timing. The page book takes free pages through
    `take_free` while this fault is on."""

    def __init__(self) -> None:
        self.robbed: dict[int, int] = {}  # page on the free list -> the owner still using it

    def rob(self, pages: Pages, seqs: list[Request]) -> None:
        for seq in seqs:
            if is_terminal(seq) or not seq.pages:
                continue
            with pages.lock:
                pages.book.free_in_use(seq.pages[:1])
                self.robbed[seq.pages[0]] = seq.seq_id

    def take_free(self, free: list[int], owner: int, count: int) -> list[int]:
        """`count` pages off the LIFO free list for `owner`, robbed ones from other owners first
        and its own last."""
        stack = free[::-1]
        mine = [p for p in stack if self.robbed.get(p) == owner]
        pages = ([p for p in stack if self.robbed.get(p) != owner] + mine)[:count]
        taken = set(pages)
        free[:] = [p for p in free if p not in taken]
        for page in pages:
            self.robbed.pop(page, None)
        return pages


def write_without_tag_check(
    pages: Pages, page: int, tag: int, tokens: int, payload: memoryview
) -> bool:
    """late-write: an aborted request's in-flight transfer write lands in the page whoever holds
    it now, with no owner or tag check. It is recorded as written under the old tag, which is
    what the read check's written-tag test catches."""
    with pages.lock:
        pages.write_page(page, tag, tokens, payload)
    return True
