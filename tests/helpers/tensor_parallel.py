"""Tensor-parallel engines in a test: rank 0 is an LLMEngine in the test's process, rank 1 one
spawned process that follows one group after another (a group per model, in turn), so that a
test of many models starts one process, not one per model."""

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.loading.loader import load_model
from kvfence_engine.parallel.follower import Follower
from kvfence_engine.parallel.group import Rendezvous, TPGroup
from kvfence_engine.tools.localproc import free_port

CPU = torch.device("cpu")


def follow_each(groups: list[tuple[Rendezvous, str, EngineArgs]]) -> None:
    """(spawned) Rank 1 of each group in turn, serving its model with its args."""
    torch.set_num_threads(1)
    for rendezvous, folder, args in groups:
        group = TPGroup(rendezvous, 1, CPU)
        Follower(group, load_model(folder), args).run()
        group.close()


@dataclass(slots=True)
class RankOne:
    """Rank 1 of a series of two-rank groups; `engine(i)` is rank 0 of the i-th."""

    groups: list[tuple[Rendezvous, str, EngineArgs]]
    process: multiprocessing.process.BaseProcess

    @contextmanager
    def engine(self, i: int) -> Iterator[LLMEngine]:
        rendezvous, folder, args = self.groups[i]
        group = TPGroup(rendezvous, 0, CPU)
        engine = LLMEngine(load_model(folder), args, group=group)
        try:
            yield engine
        finally:
            assert engine.leader is not None
            engine.leader.stop()
            group.close()


@contextmanager
def rank_one(models: list[tuple[str, EngineArgs]]) -> Iterator[RankOne]:
    """Rank 1 for a group per (folder, args), to be joined in that order."""
    groups = [(Rendezvous("127.0.0.1", free_port(), 2), f, a) for f, a in models]
    process = multiprocessing.get_context("spawn").Process(
        target=follow_each, args=(groups,), daemon=True
    )
    process.start()
    try:
        yield RankOne(groups, process)
        process.join(timeout=60)
        assert process.exitcode == 0, f"rank 1 ended with {process.exitcode}"
    finally:
        if process.is_alive():
            process.kill()
