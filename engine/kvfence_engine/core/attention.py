"""Paged attention over the KV pool: write this step's keys/values into their slots, then attend.

A decode step on CPU reads its keys and values in place through kvfence's kernel (native/ops.c)
where it can (a float32 pool, no soft-cap); elsewhere, and on CUDA outside core/device_decode,
each row's pages are gathered and attended by aten.

The read check (isolation.check_reads) has already run for the step before this is called.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F

from kvfence_engine import native


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
    # decode on a GPU (core/device_decode): attention as its kernel computes it, given q and
    # one layer's pools and scoring, instead of the gather below; slot_mapping then already
    # sends a row that failed the read check to the scratch page
    device_attend: "DeviceAttend | None" = None

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


# q [B, H, D], k_cache, v_cache (one layer), scoring -> [B, H, D]
DeviceAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "Scoring"], torch.Tensor]


def band_mask(
    queries: torch.Tensor, keys: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[len(queries), keys] True = attend: causal, and within `window` of the query."""
    key_pos = torch.arange(keys, device=device)[None, :]
    mask = key_pos <= queries[:, None]
    if window is not None:
        mask &= key_pos > queries[:, None] - window
    return mask


@dataclass(frozen=True, slots=True)
class Scoring:
    """How a layer scores keys, where a family differs from softmax(q.k / sqrt(head_dim)) over
    every earlier position: a sliding window (a query attends to itself and the window - 1
    keys before it), another scale, a tanh soft-cap of the scores (Gemma 2)."""

    window: int | None = None
    scale: float | None = None  # None: head_dim ** -0.5
    softcap: float | None = None


FULL = Scoring()


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: StepBatch,
    scoring: Scoring = FULL,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D]; k_cache/v_cache [pages, page_size, Hkv, D] (one layer).
    The pool keeps every page of a sequence; a window only masks."""
    _, page_size, kv_heads, head_dim = k_cache.shape
    # The pool may hold KV in a narrower dtype than the model computes in (--kv-cache-dtype).
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v.to(v_cache.dtype))
    window = scoring.window
    if batch.device_attend is not None:
        return batch.device_attend(q, k_cache, v_cache, scoring)
    if batch.is_prefill:
        # A prefill's keys are exactly the ones it just wrote: attend to them directly.
        outs = []
        bounds = batch.cu_seqlens
        for row, (start, end) in enumerate(pairwise(bounds)):
            cached = batch.prefix_lens[row] if batch.prefix_lens else 0
            if cached:
                outs.append(
                    _attend_after_prefix(
                        q[start:end], k_cache, v_cache, batch, row, cached, scoring
                    )
                )
                continue
            n = end - start
            mask = None
            if window is not None and n > window:
                mask = band_mask(torch.arange(n, device=q.device), n, window, q.device)
            outs.append(_one_sequence(q[start:end], k[start:end], v[start:end], scoring, mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    assert batch.page_table is not None and batch.key_mask is not None
    if q.is_cpu and scoring.softcap is None and native.Kernels.can_attend(q, k_cache):
        kernels = native.kernels()
        if isinstance(kernels, native.Kernels):  # the pages read in place, nothing gathered
            assert batch.query_positions is not None
            scale = scoring.scale if scoring.scale is not None else head_dim**-0.5
            return kernels.decode_attention(
                q, k_cache, v_cache, batch.page_table, batch.query_positions, window, scale
            )
    rows, cols = batch.page_table.shape
    flat = batch.page_table.view(-1)  # index_select: several times faster than k_cache[table]
    keys = k_cache.index_select(0, flat).view(rows, cols * page_size, kv_heads, head_dim)
    values = v_cache.index_select(0, flat).view(rows, cols * page_size, kv_heads, head_dim)
    out = _attend(
        q.unsqueeze(2),
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        scoring,
        batch.decode_mask(window),
    )
    return out.squeeze(2)


def _attend_after_prefix(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: StepBatch,
    row: int,
    cached: int,
    scoring: Scoring,
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
    queries = torch.arange(cached, total, device=q.device)
    mask = band_mask(queries, total, scoring.window, q.device)
    return _one_sequence(q, keys.to(q.dtype), values.to(q.dtype), scoring, mask)


def _one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scoring: Scoring,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence's attention: q [T, H, D], k/v [S, Hkv, D] -> [T, H, D]; no mask: causal
    over T = S. Given a batch dimension of one: PyTorch's CPU flash kernel takes only 4-D
    inputs, and 3-D ones fall back to the math path, which materializes the scores (17x
    slower at 3,000 tokens)."""
    out = _attend(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        scoring,
        mask,
    )
    return out.squeeze(0).transpose(0, 1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scoring: Scoring,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, Hkv, S, D]; mask broadcasts to [B, H, T, S] (True = attend),
    or None for causal over T = S. A soft-cap has no fused kernel: the scores are computed
    as transformers' eager attention does (softmax in float32)."""
    if scoring.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scoring.scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = scoring.scale if scoring.scale is not None else q.shape[-1] ** -0.5
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / scoring.softcap) * scoring.softcap
    if mask is None:
        mask = band_mask(torch.arange(q.shape[2], device=q.device), k.shape[2], None, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
