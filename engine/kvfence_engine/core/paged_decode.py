"""Decode on a GPU: the read check and paged attention as Triton kernels over device-resident
state (core/device_decode.py keeps it and captures them in CUDA graphs).

`check_decode` runs once per step, before the first layer: for each row of the batch it checks
every page the row holds against the pool's tags, fills and tenants (the rules of
core/isolation.check_reads, decode's read_len = the row's position), and gives the row the
KV slot it writes this step, or the scratch slot if it failed. `paged_decode_attention` then,
in every layer, reads nothing for a failed row and, for the others, only the pages holding
the keys the row attends to, all of which the check covered in this step. So no slot is read
whose page tag and fill were not checked for this sequence in this step, and a failed row
writes only into the scratch page, which no sequence holds.

The kernels run on CPU tensors under TRITON_INTERPRET=1 (the tests compare them with
core/isolation and core/attention there).
"""

from typing import Any

import torch
import triton
import triton.language as tl

# check_decode's verdicts (core/isolation's codes; the kernel writes them as literals)
from kvfence_engine.core.isolation import FOREIGN, OK, TAG_MISMATCH, UNWRITTEN

__all__ = [
    "FOREIGN",
    "OK",
    "TAG_MISMATCH",
    "UNWRITTEN",
    "check_decode",
    "decode_parts",
    "paged_decode_attention",
]
CHECK_BLOCK = 128  # page-table columns checked at a time
KEYS_PER_BLOCK = 64  # keys attention loads at a time (several pages)


@triton.jit
def _check_kernel(
    state_ptr,
    state_stride,
    table_ptr,
    held_ptr,
    table_stride,
    num_held_ptr,
    rows_ptr,
    positions_ptr,
    tenant_ptr,
    verdict_ptr,
    slots_ptr,
    scratch_slot,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    CHECK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b)
    pos = tl.load(positions_ptr + b)
    tenant = tl.load(tenant_ptr + b)
    held = tl.load(num_held_ptr + row)
    tag_bad = 0
    foreign = 0
    short = (pos > held * PAGE).to(tl.int32)  # reads positions no page was reserved for
    write_col = pos // PAGE
    short = short | (write_col >= held).to(tl.int32)  # writes where no page was reserved
    if CHECK:
        start = 0
        while start < held:  # (a while loop: Triton's interpreter runs it too)
            cols = start + tl.arange(0, BLOCK)
            live = cols < held
            page = tl.load(table_ptr + row * table_stride + cols, mask=live, other=0)
            held_tag = tl.load(held_ptr + row * table_stride + cols, mask=live, other=0)
            # the pool state's rows: tags, fill, written tags, tenants
            tag = tl.load(state_ptr + page, mask=live, other=0)
            fill = tl.load(state_ptr + state_stride + page, mask=live, other=0)
            written = tl.load(state_ptr + 2 * state_stride + page, mask=live, other=0)
            owner = tl.load(state_ptr + 3 * state_stride + page, mask=live, other=-1)
            need = tl.minimum(tl.maximum(pos - cols * PAGE, 0), PAGE)
            tag_bad = tag_bad | tl.max(((tag != held_tag) & live).to(tl.int32), axis=0)
            alien = (owner >= 0) & (owner != tenant) & live
            foreign = foreign | tl.max(alien.to(tl.int32), axis=0)
            unread = ((fill < need) | (written != held_tag)) & (need > 0) & live
            short = short | tl.max(unread.to(tl.int32), axis=0)
            start += BLOCK
    else:  # the no-tag-check fault: nothing is checked (a write still needs a page)
        short = short * 0
    # OK, TAG_MISMATCH, FOREIGN, UNWRITTEN: the first that applies
    verdict = tl.where(tag_bad != 0, 1, tl.where(foreign != 0, 2, tl.where(short != 0, 3, 0)))
    in_table = write_col < held
    page = tl.load(table_ptr + row * table_stride + write_col, mask=in_table, other=0)
    slot = page.to(tl.int64) * PAGE + pos % PAGE
    slot = tl.where((verdict == 0) & in_table, slot, scratch_slot)
    tl.store(verdict_ptr + b, verdict)
    tl.store(slots_ptr + b, slot)


def check_decode(
    pool_state: torch.Tensor,
    block_table: torch.Tensor,
    held_tags: torch.Tensor,
    num_held: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    seq_tenant: torch.Tensor,
    *,
    page_size: int,
    scratch_slot: int,
    verdict: torch.Tensor,
    slots: torch.Tensor,
    check: bool = True,
) -> None:
    """Per batch row b (a decode step: it reads positions [0, positions[b]) and writes
    positions[b]): verdict[b] = OK or why it must fail closed, slots[b] = the slot it writes.

    pool_state int32 [4, pages]: each page's tag, fill, written tag and tenant (-1: not shared).
    block_table, held_tags int32 [rows, M]: each table row's pages and the tags it holds them
    under, num_held int32 [rows] of them; rows int32 [B]: each batch row's table row;
    positions, seq_tenant int32 [B]. check=False: the no-tag-check fault."""
    batch = rows.shape[0]
    assert block_table.stride(1) == 1 and held_tags.stride() == block_table.stride()
    _check_kernel[(batch,)](
        pool_state,
        pool_state.stride(0),
        block_table,
        held_tags,
        block_table.stride(0),
        num_held,
        rows,
        positions,
        seq_tenant,
        verdict,
        slots,
        scratch_slot,
        PAGE=page_size,
        BLOCK=CHECK_BLOCK,
        CHECK=check,
    )


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attention_kernel(
    q_ptr,  # [B, H, D]
    k_ptr,  # [pages, PAGE, HKV, D] (one layer)
    v_ptr,
    table_ptr,
    table_stride,
    rows_ptr,
    positions_ptr,
    verdict_ptr,
    out_ptr,  # [B, H, D] (PARTS == 1)
    acc_ptr,  # [B, H, PARTS, D] float32 (PARTS > 1)
    ml_ptr,  # [2, B, H, PARTS] float32: running max, sum
    scale,
    softcap,
    window,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    batch = tl.num_programs(0)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    head_ok = g < GROUP
    d_ok = d < D
    ok = tl.load(verdict_ptr + b) == 0
    row = tl.load(rows_ptr + b)
    pos = tl.load(positions_ptr + b)
    first = 0
    if WINDOW:
        first = tl.maximum(pos - window + 1, 0)
    first_page = first // PAGE
    pages = pos // PAGE + 1 - first_page
    per_part = tl.cdiv(pages, PARTS)
    lo = first_page + part * per_part
    hi = tl.minimum(lo + per_part, first_page + pages)
    hi = tl.where(ok, hi, lo)  # a failed row reads nothing
    q = tl.load(
        q_ptr + (b * H + heads[:, None]) * D + d[None, :],
        mask=head_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    start = lo * PAGE
    while start < hi * PAGE:
        key = start + n
        live = (key < hi * PAGE) & (key <= pos) & (key >= first)
        page = tl.load(table_ptr + row * table_stride + key // PAGE, mask=live, other=0)
        offset = ((page.to(tl.int64) * PAGE + key % PAGE) * HKV + kvh) * D
        kv_mask = live[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        if SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m = m_new
        start += BLOCK_N
    out_mask = head_ok[:, None] & d_ok[None, :]
    if PARTS == 1:
        result = acc / tl.where(s_sum > 0, s_sum, 1.0)[:, None]  # a failed row: zeros
        tl.store(
            out_ptr + (b * H + heads[:, None]) * D + d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        at = (b * H + heads) * PARTS + part
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=out_mask)
        tl.store(ml_ptr + at, m, mask=head_ok)
        tl.store(ml_ptr + batch * H * PARTS + at, s_sum, mask=head_ok)


@triton.jit
def _combine_kernel(
    acc_ptr,
    ml_ptr,
    out_ptr,
    H: tl.constexpr,
    D: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Each (row, head): the parts' partial softmax sums merged (flash-decoding)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    batch = tl.num_programs(0)
    p = tl.arange(0, PARTS)
    d = tl.arange(0, BLOCK_D)
    at = (b * H + h) * PARTS + p
    m = tl.load(ml_ptr + at)
    s = tl.load(ml_ptr + batch * H * PARTS + at)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    total = tl.sum(s * w, axis=0)
    acc = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0)
    result = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (b * H + h) * D + d, result.to(out_ptr.dtype.element_ty), mask=d < D)


def decode_parts(batch: int, kv_heads: int, processors: int) -> int:
    """How many parts each row's keys are split into, so that a small batch still gives every
    multiprocessor work (a power of two, at most 16)."""
    parts = 1
    while parts < 16 and batch * kv_heads * parts < 2 * processors:
        parts *= 2
    return parts


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    verdict: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    parts: int = 1,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: each row attends to its keys at positions [0, positions[b]]
    (within `window` of it, if given), read from the pages of its table row; a row whose
    verdict is not OK reads nothing and gets zeros. parts > 1: each row's pages are split
    into that many parts run in parallel, then merged (scratch: their float32 buffers
    [B, H, parts, D] and [2, B, H, parts], else allocated)."""
    batch, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    if parts > 1:
        if scratch is None:
            scratch = (
                torch.empty(batch, heads, parts, dim, dtype=torch.float32, device=q.device),
                torch.empty(2, batch, heads, parts, dtype=torch.float32, device=q.device),
            )
        acc, ml = scratch
    else:
        acc = ml = out  # unused
    meta: dict[str, Any] = {
        "H": heads,
        "HKV": kv_heads,
        "D": dim,
        "PAGE": page_size,
        "GROUP": group,
        "BLOCK_G": max(16, triton.next_power_of_2(group)),
        "BLOCK_D": max(16, triton.next_power_of_2(dim)),
        "BLOCK_N": max(KEYS_PER_BLOCK, page_size),
        "PARTS": parts,
        "SOFTCAP": softcap is not None,
        "WINDOW": window is not None,
        # float32 models keep float32 products (Triton's default for them is tf32)
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }
    _attention_kernel[(batch, kv_heads, parts)](
        q,
        k_cache,
        v_cache,
        block_table,
        block_table.stride(0),
        rows,
        positions,
        verdict,
        out,
        acc,
        ml,
        scale,
        softcap or 1.0,
        window or 0,
        **meta,
    )
    if parts > 1:
        _combine_kernel[(batch, heads)](
            acc, ml, out, H=heads, D=dim, PARTS=parts, BLOCK_D=meta["BLOCK_D"]
        )
    return out
