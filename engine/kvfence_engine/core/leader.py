"""Rank 0's side of a tensor-parallel step (core/rank_orders.py): send the step, combine every
rank's read check, tell the others when the step that runs is not the one they checked; and
the other ranks' pools as its page manager reaches them (its Peers): a transferred page it
wrote goes to them with the next step, and an export joins their heads to its own."""

import logging
import os
import threading

import torch

from kvfence_engine.core.isolation import ReadCheck
from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.page_manager import PageManager
from kvfence_engine.core.rank_orders import (
    Narrowed,
    PageWrite,
    RankGroup,
    StepOrder,
    combine,
    refused_elsewhere,
    verdicts,
)
from kvfence_engine.core.runner import PreparedStep
from kvfence_engine.core.shards import plan_shards

log = logging.getLogger(__name__)
HOST = torch.device("cpu")


class Leader:
    def __init__(self, group: RankGroup, pages: PageManager, config: ModelConfig) -> None:
        self.group = group
        self.pages = pages
        # every rank's bookkeeping starts empty, as rank 0's is now: only changes travel
        pages.track_state()
        pages.peers = self
        self.refused_by_rank = [0] * group.world  # sequences only that rank's check refused
        self._writes: list[PageWrite] = []
        self._writes_lock = threading.Lock()  # receiver threads write, the engine thread sends
        # the first rank holding each span of KV heads (below world KV heads, ranks share one)
        spans = [s.kv_heads for s in plan_shards(config, group.world)]
        self._joined = [r for r, span in enumerate(spans) if span not in spans[:r]]

    def check(self, step: PreparedStep, own: ReadCheck | None) -> ReadCheck:
        """Send the step to every rank; returns the read check of all of them (own: rank 0's;
        None where the check is off)."""
        changes = self.pages.take_changes(torch.int64)
        with self._writes_lock:
            writes, self._writes = self._writes, []
        self.group.broadcast(StepOrder(changes, step.on(HOST), writes))
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

    def abandon(self, why: str) -> None:
        """(inside an except) A step failed on rank 0 partway: where the other ranks are in it
        is unknown (one may wait in a collective rank 0 will never join), so no later step
        could trust the group. The engine exits, with the traceback, and its pod restarts
        whole, as when a rank dies (parallel/launch.py)."""
        log.critical("%s on rank 0 of a tensor-parallel group: exiting", why, exc_info=True)
        logging.shutdown()
        os._exit(1)

    # --- the other ranks' pools (page_manager.Peers) -----------------------------------------

    def wrote(self, page: int, tag: int, tokens: int, payload: memoryview) -> None:
        with self._writes_lock:
            self._writes.append((page, tag, tokens, bytes(payload)))

    def join_export(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(engine thread, after the step that exports: the others send theirs then) Every KV
        head of the exported pages: [pages, layers, page_size, heads, dim]."""
        parts = self.group.gather_to_first((k, v))
        assert parts is not None
        joined = [parts[r] for r in self._joined]
        return torch.cat([p[0] for p in joined], dim=3), torch.cat([p[1] for p in joined], dim=3)
