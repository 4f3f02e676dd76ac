"""The GPU decode kernels (core/paged_decode.py), run by Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET):
the device read check decides as core/isolation.check_reads does, and paged decode attention
computes what core/attention's reference decode path computes, reading nothing for a failed
row."""

import pytest
import torch

from kvfence_engine.core.attention import Scoring, StepBatch, paged_attention
from kvfence_engine.core.isolation import check_reads
from kvfence_engine.core.paged_decode import (
    FOREIGN,
    OK,
    TAG_MISMATCH,
    UNWRITTEN,
    check_decode,
    decode_parts,
    paged_decode_attention,
)

PAGE = 4


def pool_state(pages: int, gen: torch.Generator) -> torch.Tensor:
    tags = torch.randint(1, 4, (pages,), generator=gen)
    fill = torch.randint(0, PAGE + 1, (pages,), generator=gen)
    written = tags.clone()
    tenant = torch.full((pages,), -1)
    return torch.stack([tags, fill, written, tenant]).to(torch.int32)


def run_check(state, table, held, num_held, rows, positions, tenant, *, check=True):
    batch = rows.shape[0]
    verdict = torch.full((batch,), -7, dtype=torch.int32)
    slots = torch.full((batch,), -7, dtype=torch.int64)
    check_decode(
        state,
        table,
        held,
        num_held,
        rows,
        positions,
        tenant,
        page_size=PAGE,
        scratch_slot=999,
        verdict=verdict,
        slots=slots,
        check=check,
    )
    return verdict, slots


def host_verdicts(state, table, held, num_held, rows, positions, tenant) -> list[int]:
    """core/isolation's decision for the same batch, as verdict codes."""
    r = rows.long()
    result = check_reads(
        state[0].long(),
        state[1].long(),
        state[2].long(),
        table[r].long(),
        held[r].long(),
        num_held[r].long(),
        positions.long(),
        PAGE,
        state[3].long(),
        tenant.long(),
    )
    codes = []
    for bad, alien, short in zip(
        result.tag_mismatch, result.foreign, result.unwritten, strict=True
    ):
        codes.append(TAG_MISMATCH if bad else FOREIGN if alien else UNWRITTEN if short else OK)
    return codes


@pytest.mark.parametrize("seed", range(6))
def test_check_decides_as_the_host_check(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pages, table_rows, width = 40, 6, 9
    state = pool_state(pages, gen)
    # a few pages written under an older tag, a few shared by tenants 0 and 1
    state[2, :5] -= 1
    state[3, 30:34] = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    table = torch.randint(0, pages, (table_rows, width), generator=gen, dtype=torch.int32)
    num_held = torch.randint(1, width + 1, (table_rows,), generator=gen, dtype=torch.int32)
    held = state[0][table.long()].clone()
    held[torch.rand(table.shape, generator=gen) < 0.08] += 1  # reassigned under the row
    batch = 8
    rows = torch.randint(0, table_rows, (batch,), generator=gen, dtype=torch.int32)
    # every write lands in a held page: the host check indexes the page it writes
    positions = (torch.rand(batch, generator=gen) * num_held[rows.long()] * PAGE).to(torch.int32)
    tenant = torch.randint(0, 2, (batch,), generator=gen, dtype=torch.int32)
    verdict, slots = run_check(state, table, held, num_held, rows, positions, tenant)
    expected = host_verdicts(state, table, held, num_held, rows, positions, tenant)
    assert verdict.tolist() == expected
    for b in range(batch):
        row, pos = int(rows[b]), int(positions[b])
        own = int(table[row, pos // PAGE]) * PAGE + pos % PAGE
        assert int(slots[b]) == (own if expected[b] == OK else 999)


def clean_batch():
    """Two rows, each holding fully written pages under their tags: both pass."""
    pages = 8
    state = torch.zeros(4, pages, dtype=torch.int32)
    state[0] = 5
    state[1] = PAGE
    state[2] = 5
    state[3] = -1
    table = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    held = torch.full((2, 3), 5, dtype=torch.int32)
    num_held = torch.tensor([3, 2], dtype=torch.int32)
    rows = torch.tensor([0, 1], dtype=torch.int32)
    positions = torch.tensor([9, 6], dtype=torch.int32)
    tenant = torch.tensor([0, 0], dtype=torch.int32)
    return state, table, held, num_held, rows, positions, tenant


def test_each_failure_is_named() -> None:
    batch = clean_batch()
    verdict, slots = run_check(*batch)
    assert verdict.tolist() == [OK, OK]
    assert slots.tolist() == [3 * PAGE + 1, 5 * PAGE + 2]
    state, table, held, num_held, rows, positions, tenant = batch
    stale = state.clone()
    stale[0, 2] = 6  # row 0's second page went to someone else
    assert run_check(stale, *batch[1:])[0].tolist() == [TAG_MISMATCH, OK]
    unwritten = state.clone()
    unwritten[1, 4] = 3  # row 1 reads position 3 of its first page, never written
    assert run_check(unwritten, *batch[1:])[0].tolist() == [OK, UNWRITTEN]
    late = state.clone()
    late[2, 5] = 4  # row 1's page 5 was written under an older tag (a late transfer write)
    assert run_check(late, *batch[1:])[0].tolist() == [OK, UNWRITTEN]
    shared = state.clone()
    shared[3, 1] = 1  # row 0 holds a cached page of tenant 1
    assert run_check(shared, *batch[1:])[0].tolist() == [FOREIGN, OK]
    beyond = positions.clone()
    beyond[1] = 2 * PAGE  # row 1 would write where it holds no page
    verdict, slots = run_check(state, table, held, num_held, rows, beyond, tenant)
    assert verdict.tolist() == [OK, UNWRITTEN] and int(slots[1]) == 999
    # the no-tag-check fault: nothing is refused, the writes go to the rows' own slots
    verdict, slots = run_check(stale, *batch[1:], check=False)
    assert verdict.tolist() == [OK, OK] and slots.tolist() == [3 * PAGE + 1, 5 * PAGE + 2]


def reference_decode(q, k_cache, v_cache, table, rows, positions, scoring):
    """core/attention's decode path (its writes already in the cache)."""
    r = rows.long()
    page_table = table[r].long()
    pos = positions.long()
    keys = torch.arange(page_table.shape[1] * PAGE)
    batch = StepBatch(
        is_prefill=False,
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        cu_seqlens=[],
        page_table=page_table,
        key_mask=(keys[None, :] <= pos[:, None])[:, None, None, :],
        query_positions=pos,
    )
    empty = torch.zeros(0, k_cache.shape[2], k_cache.shape[3])
    return paged_attention(q, empty, empty, k_cache, v_cache, batch, scoring)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "parts", "window", "softcap"),
    [
        (8, 2, 16, 1, None, None),
        (8, 2, 16, 4, None, None),
        (4, 4, 32, 2, None, None),
        (6, 2, 24, 1, 5, None),  # a head dim and a group that are no powers of two
        (8, 2, 16, 2, 7, 30.0),
    ],
)
def test_attention_matches_the_reference(heads, kv_heads, dim, parts, window, softcap) -> None:
    gen = torch.Generator().manual_seed(heads * dim + parts)
    pages, width, batch = 30, 8, 5
    k_cache = torch.randn(pages, PAGE, kv_heads, dim, generator=gen)
    v_cache = torch.randn(pages, PAGE, kv_heads, dim, generator=gen)
    table = torch.randperm(pages, generator=gen)[: 3 * width].view(3, width).to(torch.int32)
    rows = torch.tensor([0, 1, 2, 1, 0], dtype=torch.int32)
    positions = torch.tensor([0, 31, 17, 4, 22], dtype=torch.int32)
    q = torch.randn(batch, heads, dim, generator=gen)
    scale = dim**-0.5
    scoring = Scoring(window=window, scale=scale, softcap=softcap)
    verdict = torch.zeros(batch, dtype=torch.int32)
    got = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        positions,
        verdict,
        scale=scale,
        softcap=softcap,
        window=window,
        parts=parts,
    )
    expected = reference_decode(q, k_cache, v_cache, table, rows, positions, scoring)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_failed_row_reads_nothing() -> None:
    """Its pages are poisoned: it still gets zeros, and the other rows are untouched."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(10, PAGE, 2, 16, generator=gen)
    v_cache = torch.randn(10, PAGE, 2, 16, generator=gen)
    table = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    k_cache[4:7] = float("nan")
    v_cache[4:7] = float("nan")
    rows = torch.tensor([0, 1], dtype=torch.int32)
    positions = torch.tensor([9, 9], dtype=torch.int32)
    q = torch.randn(2, 4, 16, generator=gen)
    for parts in (1, 2):
        verdict = torch.tensor([OK, TAG_MISMATCH], dtype=torch.int32)
        out = paged_decode_attention(
            q, k_cache, v_cache, table, rows, positions, verdict, scale=0.25, parts=parts
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert bool(torch.isfinite(out[0]).all())


def test_parts_fill_a_gpu_only_when_the_batch_is_small() -> None:
    assert decode_parts(1, 8, 132) == 16
    assert decode_parts(32, 8, 132) == 2
    assert decode_parts(128, 8, 132) == 1
