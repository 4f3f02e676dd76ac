"""Paged attention over the KV pool: write this step's keys/values into their slots, then attend.

The read check (isolation.check_reads) has already run for the step before this is called.
"""

from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class StepBatch:
    """Per-step attention metadata, built once and shared by every layer."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] flat slot (page * page_size + offset) each token writes
    cu_seqlens: list[int]  # prefill: token offsets of each sequence in the flat batch
    page_table: torch.Tensor | None = None  # decode, or a prefill with prefix_lens: [B, M]
    key_mask: torch.Tensor | None = None  # decode: [B, 1, 1, M * page_size] True = attend
    # prefill: per sequence, leading positions already in the pool (a prefix-cache hit), read
    # from its pages rather than computed; None when no sequence of the batch has any
    prefix_lens: list[int] | None = None
    query_positions: torch.Tensor | None = None  # decode: [B] each row's position
    # decode: key_mask narrowed to a sliding window, by window (built by the first layer that
    # slides, shared by the others)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """The keys a decode row attends to: every written position, or within a window only
        the last `window` of them (itself included)."""
        assert self.key_mask is not None
        if window is None:
            return self.key_mask
        mask = self.window_masks.get(window)
        if mask is None:
            assert self.query_positions is not None
            keys = torch.arange(self.key_mask.shape[-1], device=self.key_mask.device)
            recent = keys[None, :] > (self.query_positions[:, None] - window)
            mask = self.window_masks[window] = self.key_mask & recent[:, None, None, :]
        return mask


def band_mask(
    queries: torch.Tensor, keys: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[len(queries), keys] True = attend: causal, and within `window` of the query."""
    key_pos = torch.arange(keys, device=device)[None, :]
    mask = key_pos <= queries[:, None]
    if window is not None:
        mask &= key_pos > queries[:, None] - window
    return mask


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: StepBatch,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D]; k_cache/v_cache [pages, page_size, Hkv, D] (one layer).
    window: this layer's sliding window (a query attends to itself and the window - 1 keys
    before it), or None. The pool keeps every page of a sequence; a window only masks."""
    _, page_size, kv_heads, head_dim = k_cache.shape
    # The pool may hold KV in a narrower dtype than the model computes in (--kv-cache-dtype).
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v.to(v_cache.dtype))
    if batch.is_prefill:
        # A prefill's keys are exactly the ones it just wrote: attend to them directly.
        outs = []
        bounds = batch.cu_seqlens
        for row, (start, end) in enumerate(pairwise(bounds)):
            cached = batch.prefix_lens[row] if batch.prefix_lens else 0
            if cached:
                outs.append(
                    _attend_after_prefix(q[start:end], k_cache, v_cache, batch, row, cached, window)
                )
                continue
            n = end - start
            if window is None or n <= window:
                out = _sdpa(q[start:end], k[start:end], v[start:end], is_causal=True)
            else:
                mask = band_mask(torch.arange(n, device=q.device), n, window, q.device)
                out = _sdpa(q[start:end], k[start:end], v[start:end], attn_mask=mask)
            outs.append(out)
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
        attn_mask=batch.decode_mask(window),
        enable_gqa=True,
    )
    return out.squeeze(2)


def _attend_after_prefix(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: StepBatch,
    row: int,
    cached: int,
    window: int | None,
) -> torch.Tensor:
    """A prefill whose first `cached` positions come from shared pages: its queries (positions
    cached ..) attend causally to every key of the sequence, read from its pages (this step's
    own keys were written there above)."""
    assert batch.page_table is not None
    _, page_size, kv_heads, head_dim = k_cache.shape
    total = cached + q.shape[0]
    pages = batch.page_table[row, : -(-total // page_size)]
    keys = k_cache.index_select(0, pages).view(-1, kv_heads, head_dim)[:total]
    values = v_cache.index_select(0, pages).view(-1, kv_heads, head_dim)[:total]
    mask = band_mask(torch.arange(cached, total, device=q.device), total, window, q.device)
    return _sdpa(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's attention: q [T, H, D], k/v [S, Hkv, D] -> [T, H, D]. Given a batch
    dimension of one: PyTorch's CPU flash kernel takes only 4-D inputs, and 3-D ones fall
    back to the math path, which materializes the scores (17x slower at 3,000 tokens)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=attn_mask,
        is_causal=is_causal,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)
