"""Starting an engine's other ranks: rank 0 (`kvfence serve --tensor-parallel-size N`, in the
process that serves HTTP) spawns ranks 1..N-1 as processes of its own, each loading the model
from the same source and following rank 0's steps (parallel/follower.py). A rank that dies
ends the engine: a group short of a rank cannot compute a step, so rank 0 exits and the
kubelet (or `kvfence up`) restarts the pod whole; a rank whose parent died exits too. Signals
are rank 0's: the others ignore SIGINT and SIGTERM and end when rank 0 ends the group."""

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvfence_engine.core.engine import EngineArgs
from kvfence_engine.parallel.group import Rendezvous, TPGroup

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the one asked for (cuda, cuda:N), or the CPU."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def check_devices(device: str, world: int) -> None:
    """ValueError unless there is a device for every rank: N GPUs from the one asked for."""
    base = torch.device(device)
    if base.type != "cuda":
        return
    first, have = base.index or 0, torch.cuda.device_count()
    if first + world > have:
        raise ValueError(
            f"--tensor-parallel-size {world} needs GPUs cuda:{first}..cuda:{first + world - 1}; "
            f"this machine has {have}"
        )


def rank_threads(threads: int | None, world: int) -> int:
    """A rank's CPU threads: --threads each, or the machine's cores shared among the ranks."""
    return threads or max(1, (os.cpu_count() or 1) // world)


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank's process is started with (pickled on its stdin: the group's own pod)."""

    rendezvous: Rendezvous
    rank: int
    model: str
    args: EngineArgs
    threads: int
    parent: int


@dataclass(slots=True)
class Ranks:
    """Ranks 1..N-1 of one engine, as processes of this one (processes[i] is rank i + 1)."""

    rendezvous: Rendezvous
    processes: list[subprocess.Popen[bytes]]
    _stopping: threading.Event = field(default_factory=threading.Event)
    _told: threading.Lock = field(default_factory=threading.Lock)

    def join_as_rank0(self, device: str) -> TPGroup:
        """This process's place in the group, once every rank has joined it."""
        return TPGroup(self.rendezvous, 0, rank_device(device, 0))

    def watch(self, on_death: Callable[[int, int | None], None]) -> None:
        """Call on_death(rank, exit code) once if a rank ends before stop() (from a thread)."""

        def watch(rank: int, process: subprocess.Popen[bytes]) -> None:
            code = process.wait()
            if not self._stopping.is_set() and self._told.acquire(blocking=False):
                on_death(rank, code)

        for rank, process in enumerate(self.processes, start=1):
            name = f"kvfence-rank-{rank}-watch"
            threading.Thread(target=watch, args=(rank, process), name=name, daemon=True).start()

    def stop(self, end_group: Callable[[], None] = lambda: None, timeout: float = 10.0) -> None:
        """End the group (end_group: rank 0's Leader.stop), wait for the ranks to exit, and
        end those that do not."""
        self._stopping.set()  # from here on, a rank's exit is expected
        end_group()
        deadline = time.monotonic() + timeout
        for p in self.processes:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_ranks(
    world: int, model: str, args: EngineArgs, port: int, threads: int | None = None
) -> Ranks:
    """Start ranks 1..world-1 of an engine serving `model` with `args`; they meet rank 0 at
    `port` on loopback (Ranks.join_as_rank0). Each is `python -m kvfence_engine.parallel.launch`
    (not multiprocessing's: an engine may itself be a daemonic process, which may have none),
    its output this process's."""
    rendezvous = Rendezvous(LOOPBACK, port, world)
    processes = []
    for rank in range(1, world):
        spec = RankSpec(rendezvous, rank, model, args, rank_threads(threads, world), os.getpid())
        p = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE)
        assert p.stdin is not None
        p.stdin.write(pickle.dumps(spec))
        p.stdin.close()
        processes.append(p)
    return Ranks(rendezvous, processes)


def follower_main(spec: RankSpec) -> None:
    """A rank's process: join the group, load the model, follow rank 0 until it ends the
    group."""
    from kvfence_engine.loading.loader import load_model
    from kvfence_engine.parallel.follower import Follower

    rank, world = spec.rank, spec.rendezvous.world
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    # Rank 0 ends this rank (its last order, or its death): a signal to the whole process
    # group (Ctrl-C on a terminal, `timeout`) is rank 0's to handle, which ends the group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with(spec.parent)
    torch.set_num_threads(spec.threads)
    group = TPGroup(spec.rendezvous, rank, rank_device(spec.args.device, rank))
    follower = Follower(group, load_model(spec.model), spec.args)
    log.info("rank %d of %d ready", rank, world)
    follower.run()
    log.info("rank %d: rank 0 ended the group after %d steps", rank, follower.steps)
    group.close()


def _exit_with(parent: int) -> None:
    """End this process when `parent` is gone (even killed: no atexit of its ran)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kvfence-parent-watch", daemon=True).start()


if __name__ == "__main__":
    follower_main(pickle.load(sys.stdin.buffer))
