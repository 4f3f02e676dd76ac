"""Paged attention over the KV pool: write this step's keys/values into their slots, then attend.

The read check (isolation.check_reads) has already run for the step before this is called.
"""

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class StepBatch:
    """Per-step attention metadata, built once and shared by every layer."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] flat slot (page * page_size + offset) each token writes
    cu_seqlens: list[int]  # prefill: token offsets of each sequence in the flat batch
    page_table: torch.Tensor | None = None  # decode: [B, M] pages to gather
    key_mask: torch.Tensor | None = None  # decode: [B, 1, 1, M * page_size] True = attend


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: StepBatch,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D]; k_cache/v_cache [pages, page_size, Hkv, D] (one layer)."""
    _, page_size, kv_heads, head_dim = k_cache.shape
    # The pool may hold KV in a narrower dtype than the model computes in (--kv-cache-dtype).
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v.to(v_cache.dtype))
    if batch.is_prefill:
        # A prefill's keys are exactly the ones it just wrote: attend to them directly.
        outs = []
        bounds = batch.cu_seqlens
        for start, end in pairwise(bounds):
            out = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                is_causal=True,
                enable_gqa=True,
            )
            outs.append(out.transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    assert batch.page_table is not None and batch.key_mask is not None
    rows, cols = batch.page_table.shape
    flat = batch.page_table.view(-1)  # index_select: several times faster than k_cache[table]
    keys = k_cache.index_select(0, flat).view(rows, cols * page_size, kv_heads, head_dim)
    values = v_cache.index_select(0, flat).view(rows, cols * page_size, kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=batch.key_mask,
        enable_gqa=True,
    )
    return out.squeeze(2)
