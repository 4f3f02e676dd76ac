"""Tensor-parallel engines in a test: rank 0 is an LLMEngine in the test's process, rank 1 one
spawned process; they share one two-rank group, in which one engine after another runs (each
ends its followers' loop when it is done, and rank 1 starts the next model's), so that a test
of many models starts one process and one group, not one per model."""

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


def follow_each(rendezvous: Rendezvous, models: list[tuple[str, EngineArgs]]) -> None:
    """(spawned) Rank 1 of each engine in turn, serving its model with its args."""
    torch.set_num_threads(1)
    group = TPGroup(rendezvous, 1, CPU)
    for folder, args in models:
        Follower(group, load_model(folder), args).run()
    group.close()


@dataclass(slots=True)
class RankOne:
    """Rank 1 of the group; `engine(i)` is rank 0 of the i-th engine, in order."""

    models: list[tuple[str, EngineArgs]]
    group: TPGroup
    process: multiprocessing.process.BaseProcess

    @contextmanager
    def engine(self, i: int) -> Iterator[LLMEngine]:
        folder, args = self.models[i]
        engine = LLMEngine(load_model(folder), args, group=self.group)
        try:
            yield engine
        finally:
            assert engine.leader is not None
            engine.leader.stop()


@contextmanager
def rank_one(models: list[tuple[str, EngineArgs]]) -> Iterator[RankOne]:
    """Rank 1 for an engine per (folder, args), to be run in that order, every one of them."""
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2)
    process = multiprocessing.get_context("spawn").Process(
        target=follow_each, args=(rendezvous, models), daemon=True
    )
    process.start()
    group = TPGroup(rendezvous, 0, CPU)
    try:
        yield RankOne(models, group, process)
        process.join(timeout=60)
        assert process.exitcode == 0, f"rank 1 ended with {process.exitcode}"
    finally:
        group.close()
        if process.is_alive():
            process.kill()
