"""Which part of the model each rank holds, and its share of a checkpoint's tensors (pure: no
process group).

- Attention: whole KV heads per rank, with the query heads of their groups, so that each rank
  attends on its own (no communication inside attention). The KV heads are split as evenly as
  they go (SmolLM2's 3 over 2 ranks: 2 and 1, its 9 query heads 6 and 3); with fewer KV heads
  than ranks, each is replicated over world / kv ranks, which split its group of query heads.
  q/k/v rows (and biases) are column-parallel; o_proj's columns row-parallel, its output summed
  over the ranks (one all-reduce).
- MLP: gate/up rows and down's columns split as evenly as they go, one all-reduce after down.
  A MoE's experts are split the same way, each expert on every rank (its router replicated, so
  every rank routes a token alike), one all-reduce after the layer's experts.
- Vocabulary: the embedding's rows (and the lm_head's, tied or not) split as evenly as they go;
  an embedding lookup is summed over the ranks, the logits gathered.
- A bias added after a sum (o_proj's, down's) is rank 0's; the others hold zeros.
- Norms, the router and everything else: replicated.

A packed GGUF's int4 groups are split with their weights; a row-parallel split must then fall
on their 32-wide groups, or the model is refused for int4 at that size.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.quantization import GROUP, Int4Groups


@dataclass(frozen=True, slots=True)
class Span:
    """[start, stop) of one dimension."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def even_spans(total: int, parts: int) -> list[Span]:
    """`total` split into `parts` contiguous spans as even as they go (the first ones larger),
    torch.tensor_split's rule."""
    base, extra = divmod(total, parts)
    spans, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        spans.append(Span(start, start + size))
        start += size
    return spans


@dataclass(frozen=True, slots=True)
class RankShard:
    """What rank `rank` of `world` holds: query heads, KV heads, vocabulary rows, and the span
    of an MLP's hidden units (intermediate_size or an expert's) by their count."""

    rank: int
    world: int
    q_heads: Span
    kv_heads: Span
    vocab: Span

    def hidden(self, intermediate: int) -> Span:
        return even_spans(intermediate, self.world)[self.rank]

    @property
    def adds_biases(self) -> bool:
        """Whether this rank adds the biases that follow a sum over the ranks."""
        return self.rank == 0


def plan_shards(config: ModelConfig, world: int) -> list[RankShard]:
    """Each rank's part, or ValueError naming why the model does not split over `world`."""
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {world}")
    heads, kv = config.num_heads, config.num_kv_heads
    group = heads // kv
    if world > heads:
        raise ValueError(
            f"--tensor-parallel-size {world}: the model has {heads} attention heads, fewer "
            "than the ranks"
        )
    if world > config.vocab_size:
        raise ValueError(f"--tensor-parallel-size {world} exceeds the vocabulary")
    vocab = even_spans(config.vocab_size, world)
    if kv >= world:
        kv_spans = even_spans(kv, world)
        q_spans = [Span(s.start * group, s.stop * group) for s in kv_spans]
    else:
        if world % kv:
            raise ValueError(
                f"--tensor-parallel-size {world}: the model's {kv} KV heads are fewer than the "
                f"ranks, and the ranks are not a multiple of them (each KV head is replicated "
                f"over an equal number of ranks)"
            )
        copies = world // kv  # at most the group's query heads: world <= heads
        kv_spans, q_spans = [], []
        for rank in range(world):
            head, part = divmod(rank, copies)
            kv_spans.append(Span(head, head + 1))
            share = even_spans(group, copies)[part]
            q_spans.append(Span(head * group + share.start, head * group + share.stop))
    return [RankShard(r, world, q_spans[r], kv_spans[r], vocab[r]) for r in range(world)]


def rank_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The config a rank's layers are built from: its query and KV heads."""
    return replace(config, num_heads=shard.q_heads.size, num_kv_heads=shard.kv_heads.size)


# How a tensor is split, by its name's ending: the rows ("out": column-parallel linears, the
# vocabulary) or the columns ("in": row-parallel linears) along which span of what.
ATTENTION_ROWS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv"}
MLP_ROWS = ("gate_proj", "up_proj")
SUMMED = ("o_proj", "down_proj")  # row-parallel: their input split, their output summed


def shard_checkpoint(
    config: ModelConfig,
    shard: RankShard,
    weights: dict[str, torch.Tensor],
    int4: dict[str, Int4Groups],
) -> tuple[dict[str, torch.Tensor], dict[str, Int4Groups]]:
    """This rank's share of every tensor (and of every int4-grouped weight), by name."""
    d = config.head_dim
    q_rows = Span(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv_rows = Span(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    heads_rows = {"q": q_rows, "kv": kv_rows}

    def rows_of(name: str, full: int) -> list[tuple[int, Span]] | None:
        """[(offset of a stacked part, its span)] of a column-parallel weight's rows, or None
        where the tensor is not split by rows."""
        base, _, _ = name.rpartition(".")  # drop weight / bias
        leaf = base.rpartition(".")[2]
        if leaf in ATTENTION_ROWS:
            return [(0, heads_rows[ATTENTION_ROWS[leaf]])]
        if leaf == "qkv_proj":  # Phi-3: q, k and v rows stacked
            q, kv = config.num_heads * d, config.num_kv_heads * d
            return [(0, q_rows), (q, kv_rows), (q + kv, kv_rows)]
        if leaf in MLP_ROWS:
            return [(0, shard.hidden(full))]
        if leaf == "gate_up_proj":  # Phi-3: gate rows, then up rows
            half = full // 2
            return [(0, shard.hidden(half)), (half, shard.hidden(half))]
        if base in ("model.embed_tokens", "lm_head"):
            return [(0, shard.vocab)]
        return None

    def cols_of(name: str, full: int) -> Span | None:
        base = name.rpartition(".")[0]
        leaf = base.rpartition(".")[2]
        if leaf == "o_proj":
            return q_rows
        if leaf == "down_proj":
            return shard.hidden(full)
        return None

    def take_rows(t: torch.Tensor, parts: list[tuple[int, Span]]) -> torch.Tensor:
        return torch.cat([t[o + s.start : o + s.stop] for o, s in parts])

    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        out[name] = _split(name, tensor, rows_of, cols_of, take_rows, shard.adds_biases)
    groups: dict[str, Int4Groups] = {}
    for name, g in int4.items():
        parts = rows_of(name, g.q.shape[0])
        span = cols_of(name, g.q.shape[1])
        if parts is not None:
            groups[name] = Int4Groups(
                take_rows(g.q, parts), take_rows(g.scale, parts), take_rows(g.zero, parts)
            )
        elif span is not None:
            if span.start % GROUP or span.stop % GROUP:
                raise ValueError(
                    f"{name}: its inputs {span.start}..{span.stop} on rank {shard.rank} do not "
                    f"fall on int4's groups of {GROUP}; use --weight-dtype float16 at this "
                    "tensor-parallel size"
                )
            a, b = span.start // GROUP, span.stop // GROUP
            groups[name] = Int4Groups(
                g.q[:, span.start : span.stop], g.scale[:, a:b], g.zero[:, a:b]
            )
        else:
            groups[name] = g
    return out, groups


def _split(
    name: str,
    tensor: torch.Tensor,
    rows_of: Callable[[str, int], list[tuple[int, Span]] | None],
    cols_of: Callable[[str, int], Span | None],
    take_rows: Callable[[torch.Tensor, list[tuple[int, Span]]], torch.Tensor],
    adds_biases: bool,
) -> torch.Tensor:
    parts = rows_of(name, tensor.shape[0])
    if parts is not None:
        return take_rows(tensor, parts).contiguous()
    if tensor.ndim == 2:
        span = cols_of(name, tensor.shape[1])
        if span is not None:
            return tensor[:, span.start : span.stop].contiguous()
    elif name.endswith(".bias") and name.rpartition(".")[0].endswith(SUMMED):
        return tensor if adds_biases else torch.zeros_like(tensor)
    return tensor
