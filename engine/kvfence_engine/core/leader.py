"""Rank 0's side of a tensor-parallel step (core/rank_orders.py): send the step, combine every
rank's read check, tell the others when the step that runs is not the one they checked."""

import logging

import torch

from kvfence_engine.core.isolation import ReadCheck
from kvfence_engine.core.page_manager import PageManager
from kvfence_engine.core.rank_orders import (
    Narrowed,
    RankGroup,
    StepOrder,
    combine,
    refused_elsewhere,
    verdicts,
)
from kvfence_engine.core.runner import PreparedStep

log = logging.getLogger(__name__)
HOST = torch.device("cpu")


class Leader:
    def __init__(self, group: RankGroup, pages: PageManager) -> None:
        self.group = group
        self.pages = pages
        # every rank's bookkeeping starts empty, as rank 0's is now: only changes travel
        pages.track_state()
        self.refused_by_rank = [0] * group.world  # sequences only that rank's check refused

    def check(self, step: PreparedStep, own: ReadCheck | None) -> ReadCheck:
        """Send the step to every rank; returns the read check of all of them (own: rank 0's;
        None where the check is off)."""
        changes = self.pages.take_changes(torch.int64)
        self.group.broadcast(StepOrder(changes, step.on(HOST)))
        gathered = self.group.gather_host(verdicts(own, len(step.num_held)))
        others = refused_elsewhere(gathered)
        if others:
            for rank in others:
                self.refused_by_rank[rank] += 1
            log.warning(
                "the read check on rank %s refused sequences that rank 0's passed: refused on "
                "every rank",
                ", ".join(map(str, others)),
            )
        return combine(gathered)

    def narrow(self, step: PreparedStep | None) -> None:
        """The step that runs instead of the checked one (None: none runs)."""
        self.group.broadcast(Narrowed(None if step is None else step.on(HOST)))

    def stop(self) -> None:
        """End the other ranks' loops."""
        self.group.broadcast(None)
