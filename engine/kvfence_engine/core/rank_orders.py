"""What rank 0 sends the other ranks of its group, and how their read checks are combined: the
typed contract between an engine's ranks (a RankGroup's broadcast carries it; the group over
torch.distributed is parallel/group.TPGroup).

A step, on every rank: rank 0 sends a StepOrder (the pool's bookkeeping changes since the last
one, the transferred pages it wrote since, and the step's tensors); each rank brings its mirror
of the bookkeeping up to date (`follow_changes`), writes those pages into its own pool, runs
the read check against its mirror, and every rank's verdicts are gathered to every rank
(`combine`). A sequence any rank refused is refused on all. If none was, every rank runs the
step it checked; else rank 0 sends a Narrowed order, the step without the refused sequences (or
none left), and every rank runs that one. After it, each rank's part of every page the step
exports (prefill role: step.exports) is gathered to rank 0, which joins them. A None order
ends the followers.
"""

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvfence_engine.core.decoder import Collectives
from kvfence_engine.core.isolation import ReadCheck
from kvfence_engine.core.page_book import PageBook
from kvfence_engine.core.runner import PreparedStep


class RankGroup(Collectives, Protocol):
    """An engine's ranks, as this process's rank sees them."""

    @property
    def rank(self) -> int: ...
    @property
    def world(self) -> int: ...
    @property
    def device(self) -> torch.device: ...

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0's message on every rank (rank 0 passes it, the others get it)."""

    def gather_host(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's host tensor x, stacked: [world, *x.shape]."""

    def gather_to_first(self, obj: Any) -> list[Any] | None:
        """Every rank's obj, in rank order, on rank 0 (None on the others)."""


# (pages, their state): PageManager.take_changes(torch.int64), rows tag, fill, written tag,
# tenant (PageBook.read_state)
PoolChanges = tuple[torch.Tensor, torch.Tensor]


# A transferred page rank 0 wrote (decode role): page, tag, tokens, the whole page's bytes
PageWrite = tuple[int, int, int, bytes]


@dataclass(frozen=True, slots=True)
class StepOrder:
    changes: PoolChanges | None  # None: no page's bookkeeping changed
    step: PreparedStep  # on the host
    writes: list[PageWrite]  # since the last order, in the order rank 0 wrote them


@dataclass(frozen=True, slots=True)
class Narrowed:
    step: PreparedStep | None  # the checked step less what was refused; None: nothing left


def follow_changes(book: PageBook, changes: PoolChanges) -> torch.Tensor:
    """Bring a rank's mirror of rank 0's bookkeeping up to date: each changed page's tag and
    tenant become rank 0's. Its fill is this rank's own (its own writes raise it: an
    unwritten slot of its own heads is unwritten whatever rank 0 wrote) and starts again
    from 0 where rank 0's did (a page released) or the tag moved on (a page reallocated), as
    PageBook does. Returns the pages whose fill started again."""
    pages, state = changes
    tags, fill, tenant = state[0], state[1], state[3]
    reset = pages[(book.tags[pages] != tags) | (fill == 0)]
    book.fill[reset] = 0
    book.tags[pages] = tags
    book.page_tenant[pages] = tenant
    return reset


VERDICTS = 3  # rows of a rank's verdicts: tag mismatch, foreign, unwritten


def verdicts(check: ReadCheck | None, rows: int) -> torch.Tensor:
    """A rank's read check as int64 [3, rows] (None: the check is off, nothing refused)."""
    if check is None:
        return torch.zeros(VERDICTS, rows, dtype=torch.int64)
    return torch.stack([check.tag_mismatch, check.foreign, check.unwritten]).to(torch.int64)


def combine(gathered: torch.Tensor) -> ReadCheck:
    """Every rank's verdicts [world, 3, rows] as one check: a sequence fails for the first
    reason (tag mismatch, then a foreign page, then unwritten slots) any rank found."""
    found = gathered.bool().any(dim=0)
    tag, foreign, unwritten = found[0], found[1], found[2]
    foreign = foreign & ~tag
    return ReadCheck(tag_mismatch=tag, foreign=foreign, unwritten=unwritten & ~tag & ~foreign)


def refused_elsewhere(gathered: torch.Tensor) -> list[int]:
    """The ranks other than 0 that refused a sequence rank 0 passed."""
    passed_here = ~gathered[0].bool().any(dim=0)
    return [
        rank
        for rank in range(1, gathered.shape[0])
        if bool((gathered[rank].bool().any(dim=0) & passed_here).any())
    ]
