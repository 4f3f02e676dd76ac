"""The model an engine runs and the size of its KV pool, built from a loaded checkpoint, whole
or as one rank's part of a tensor-parallel group (core/shards.py): the same functions for
rank 0's engine (core/engine.py) and the ranks that follow it (parallel/follower.py), so that
every rank holds its part of one model and as many pages."""

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from kvfence_engine.core.choice_cache import ChoiceCache
from kvfence_engine.core.decoder import Decoder, RankPart
from kvfence_engine.core.families import build_model
from kvfence_engine.core.kv_cache import KVCache
from kvfence_engine.core.model_config import ModelConfig, positions_note
from kvfence_engine.core.pool_plan import PoolPlan, plan_pool
from kvfence_engine.core.quantization import Int4Groups, Precision, resolve_precision
from kvfence_engine.core.shard_weights import shard_checkpoint
from kvfence_engine.core.shards import plan_shards, pool_shape, rank_config
from kvfence_engine.core.weight_choice import CONCURRENCY, choose_packing, pack, step_times

if TYPE_CHECKING:
    from kvfence_engine.core.rank_orders import RankGroup

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = 512 * 1024**2


class BuildSettings(Protocol):
    """The engine's settings (core/engine.EngineArgs) that decide the model and its pool."""

    @property
    def weight_dtype(self) -> str | None: ...
    @property
    def weight_choice_cache(self) -> str | None: ...
    @property
    def kv_cache_dtype(self) -> str | None: ...
    @property
    def context_length(self) -> int | None: ...
    @property
    def page_size(self) -> int: ...
    @property
    def kv_cache_memory(self) -> int | None: ...
    @property
    def memory_fraction(self) -> float | None: ...
    @property
    def max_num_seqs(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Built:
    """One rank's model, and its pool's plan (the same on every rank)."""

    model: Decoder
    precision: Precision
    context: int  # the positions asked for (--context-length, or the model's)
    plan: PoolPlan
    kv_dtype: torch.dtype
    kv_heads: tuple[int, int]  # [start, stop) of the model's KV heads this rank's pool holds

    def kv_cache(self, config: ModelConfig, device: torch.device, **options: bool) -> KVCache:
        """This rank's pool: plan.num_pages pages of its KV heads."""
        return KVCache(
            num_layers=config.num_layers,
            num_pages=self.plan.num_pages,
            page_size=self.plan.page_size,
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            head_dim=config.head_dim,
            dtype=self.kv_dtype,
            device=device,
            heads=self.kv_heads,
            total_heads=config.num_kv_heads,
            **options,
        )


def build_rank(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    int4: dict[str, Int4Groups],
    settings: BuildSettings,
    device: torch.device,
    group: "RankGroup | None" = None,
) -> Built:
    """The model (this rank's part, with `group`) and the plan of the pool beside it: sized
    for the smallest budget of any rank, measured after every rank's model is in place."""
    precision = resolve_precision(settings.weight_dtype, device, bool(int4))
    context = settings.context_length or config.max_positions
    if context > config.max_positions:
        raise ValueError(
            f"--context-length {context} exceeds the model's {config.max_positions} "
            f"positions{positions_note(config)}"
        )
    if context < 1:
        raise ValueError("--context-length must be >= 1")
    model, precision = build_packed_model(
        config,
        weights,
        int4,
        precision,
        device,
        context,
        group,
        settings.max_num_seqs,
        settings.weight_choice_cache,
    )
    kv_dtype = (
        precision.compute
        if settings.kv_cache_dtype is None
        else getattr(torch, settings.kv_cache_dtype)
    )
    budget = kv_budget(settings, device)
    world, kv_heads = 1, (0, config.num_kv_heads)
    if group is not None:
        world = group.world
        budget = int(group.gather_host(torch.tensor([budget], dtype=torch.int64)).min())
        span = plan_shards(config, world)[group.rank].kv_heads
        kv_heads = (span.start, span.stop)
    plan = plan_pool(
        pool_shape(config, world),
        page_size=settings.page_size,
        dtype_bytes=torch.finfo(kv_dtype).bits // 8,
        budget_bytes=budget,
    )
    return Built(model, precision, context, plan, kv_dtype, kv_heads)


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_budget(settings: BuildSettings, device: torch.device) -> int:
    """The bytes the pool may take on `device`: --kv-cache-memory, --memory-fraction of what
    is free, or the defaults (90% of a GPU's free memory; 512 MiB on CPU)."""
    if settings.kv_cache_memory is not None:
        return settings.kv_cache_memory
    if settings.memory_fraction is not None:
        fraction = settings.memory_fraction
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"--memory-fraction must be in (0, 1], got {fraction}")
        return int(_available_memory(device) * fraction)
    if device.type == "cuda":
        return int(_available_memory(device) * 0.9)
    return DEFAULT_CPU_KV_MEMORY


def build_packed_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    int4: dict[str, Int4Groups],
    precision: Precision,
    device: torch.device,
    context: int,
    group: "RankGroup | None" = None,
    max_num_seqs: int = CONCURRENCY,
    choice_cache: str | None = None,
) -> tuple[Decoder, Precision]:
    """The model (with `group`, this rank's part of it) on `device` in `precision`, its
    linears packed as the precision says, or, where it has candidates, as the one measured
    fastest on this CPU (core/weight_choice.py) for up to `max_num_seqs` rows; and that
    precision; `choice_cache`, a directory where that measurement is kept for the next
    start (core/choice_cache.py). Takes the weights: empties both dicts."""
    part = None
    if group is not None:
        shards = plan_shards(config, group.world)
        shard = shards[group.rank]
        weights, int4 = shard_checkpoint(config, shard, weights, int4)
        config = rank_config(config, shard)
        widths = tuple(s.vocab.size for s in shards)
        part = RankPart(group, shard.vocab.start, widths, group.rank)
    model = build_model(config, weights, context, part).to(device, precision.compute)
    if len(precision.candidates) > 1 and group is None:
        rows = min(CONCURRENCY, max_num_seqs)
        cache = None
        if choice_cache is not None:
            cache = ChoiceCache(Path(choice_cache), config, precision.candidates, rows)
        choice = choose_packing(model, int4, precision.candidates, step_times(rows), cache=cache)
        why = choice.reason()
        precision = replace(precision, weights=choice.chosen, packed=choice.chosen, why=why)
        log.info("%s", why)
    elif (packed := precision.packed) is not None:
        if precision.candidates:  # every rank must pack alike: no rank measures alone
            why = f"auto serves {packed} unmeasured: tensor parallelism"
            precision = replace(precision, why=why)
            log.info("%s", why)
        pack(model, packed, int4)
    weights.clear()  # the model holds them now
    int4.clear()
    return model, precision
