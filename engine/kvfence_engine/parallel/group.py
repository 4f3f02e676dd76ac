"""The ranks of one engine as a torch.distributed group: NCCL between GPUs, gloo on CPU, and a
gloo group beside NCCL for what rank 0 sends the others on the host (its step orders), as vLLM
keeps a CPU group beside its device group. The same code drives both backends."""

import datetime
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A follower waits for rank 0's next step as long as the engine is idle: no timeout of its own
# (a rank that dies is noticed by the launcher, parallel/launch.py, which ends the group)
IDLE_FOREVER = datetime.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks meet: rank 0's TCP store (127.0.0.1: they share a pod)."""

    host: str
    port: int
    world: int


class TPGroup:
    """This process's rank of the group, and the collectives the model and the step need."""

    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device) -> None:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{rendezvous.host}:{rendezvous.port}",
            rank=rank,
            world_size=rendezvous.world,
            timeout=IDLE_FOREVER,
        )
        self.rank = rank
        self.world = rendezvous.world
        self.device = device
        # host messages: gloo whatever the device backend
        self.host = dist.new_group(backend="gloo", timeout=IDLE_FOREVER)
        # seconds this rank spent in the model's collectives (bench/tensor_parallel.py)
        self.collective_seconds = 0.0

    # --- the model's collectives (device tensors) -----------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (a row-parallel linear's partial outputs)."""
        started = time.perf_counter()
        dist.all_reduce(x)
        self.collective_seconds += time.perf_counter() - started
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's x [rows, widths[rank]] side by side: [rows, sum(widths)]."""
        started = time.perf_counter()
        widest = max(widths)
        padded = torch.zeros(x.shape[0], widest, dtype=x.dtype, device=x.device)
        padded[:, : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        joined = torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)
        self.collective_seconds += time.perf_counter() - started
        return joined

    # --- the step's host messages ----------------------------------------------------------

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0's message, on every rank (rank 0 passes it; the others get it). Pickled:
        the ranks are one pod's processes, started by rank 0 (parallel/launch.py)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            dist.broadcast(size, 0, group=self.host)
            dist.broadcast(data, 0, group=self.host)
            return message
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.host)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.host)
        return pickle.loads(data.numpy().tobytes())

    def gather_to_first(self, obj: Any) -> list[Any] | None:
        """Every rank's obj, in rank order, on rank 0 (None on the others)."""
        parts: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, parts, dst=0, group=self.host)
        return parts

    def gather_host(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's host tensor x (one shape on all), stacked: [world, *x.shape]."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.host)
        return torch.stack(parts)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
