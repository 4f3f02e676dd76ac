"""A rank other than 0: its part of the model and of the KV pool, and a mirror of rank 0's
page bookkeeping against which it runs the read check on its own; it runs the steps rank 0
sends it (core/rank_orders.py) until rank 0 ends the group."""

import logging

from kvfence_engine.core.build import build_rank
from kvfence_engine.core.engine import EngineArgs, EosTokens, ModelFiles
from kvfence_engine.core.faults import Fault
from kvfence_engine.core.page_manager import PageManager
from kvfence_engine.core.rank_orders import Narrowed, StepOrder, combine, follow_changes, verdicts
from kvfence_engine.core.runner import ModelRunner, PreparedStep, check_step
from kvfence_engine.parallel.group import TPGroup

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, group: TPGroup, loaded: ModelFiles[EosTokens], args: EngineArgs) -> None:
        assert group.rank > 0
        self.group = group
        self.args = args
        config = loaded.config
        built = build_rank(config, loaded.weights, loaded.int4, args, group.device, group)
        self.kv = built.kv_cache(config, group.device)
        # Its book is a mirror of rank 0's (orders.follow_changes), never allocated from.
        self.pages = PageManager(self.kv)
        self.runner = ModelRunner(built.model, self.pages, group.device, args.faults)
        self.check = Fault.NO_TAG_CHECK not in args.faults
        # the fault: the last rank's mirror stops following rank 0's bookkeeping
        self.desync = Fault.RANK_DESYNC in args.faults and group.rank == group.world - 1
        self.steps = 0

    def run(self) -> None:
        """Follow rank 0's steps until it ends the group."""
        while (order := self.group.broadcast()) is not None:
            assert isinstance(order, StepOrder), order
            self.step(order)

    def step(self, order: StepOrder) -> None:
        if order.changes is not None and not self.desync:
            reset = follow_changes(self.pages.book, order.changes)
            if self.args.scrub_on_free and len(reset):
                self.kv.scrub(reset.tolist())
        for page, tag, tokens, payload in order.writes:  # its heads of each transferred page
            self.kv.write(page, tokens, memoryview(payload))
            self.pages.book.mark_written(page, tag, tokens)
        step: PreparedStep | None = order.step.on(self.group.device)
        check = check_step(self.pages.book, order.step) if self.check else None
        gathered = self.group.gather_host(verdicts(check, len(order.step.num_held)))
        if bool(combine(gathered).failed.any()):  # rank 0 sends what runs instead
            narrowed = self.group.broadcast()
            assert isinstance(narrowed, Narrowed), narrowed
            step = None if narrowed.step is None else narrowed.step.on(self.group.device)
        if step is not None:
            self.runner.run(step)
            for pages in step.exports:  # rank 0 joins them to its own (Leader.join_export)
                self.group.gather_to_first(self.kv.export(pages))
        self.steps += 1
