"""A rank's share of a checkpoint's tensors, by name, as core/shards.py's plan says: the rows
of column-parallel weights (q/k/v, gate/up, the vocabulary), the columns of row-parallel ones
(o_proj, down), rank 0 alone keeping a bias added after a sum; everything else replicated.

A packed GGUF's int4 groups are split with their weights; a row-parallel split must then fall
on their 32-wide groups, or the model is refused for int4 at that size.
"""

from collections.abc import Callable

import torch

from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.quantization import GROUP, Int4Groups
from kvfence_engine.core.shards import RankShard, Span

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
