"""The device-side read check of bench/gpu_check.py: `check_decode` (a Triton kernel in
kvfence_engine.core.paged_decode) timed alone, on a synthetic but consistent pool state.

The state is that of the last decode step of a batch that arrived together: row b holds
ceil((prompt_b + new) / page_size) pages, drawn at random from the whole pool, each under its
own random tag; every position before the one it writes (prompt_b + new - 1) is written under
that tag, the rest of its last page is not; no page is shared (tenant -1). That is the most a
row of that batch ever checks, so the share of the mean decode step it gives is an upper bound.
Every row must pass, and each must get the slot of its position in its own page table: a
kernel that disagrees is reported (rows_failed, slots_wrong), not trusted.

Timing needs CUDA and Triton (triton.testing.do_bench: CUDA events, the median of as many
launches as fit its default 100 ms, after its warm-up); building the state does not, so tests
check it on the CPU against core/isolation.check_reads, the host check it mirrors.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from kvfence_engine.core.page_book import NO_TENANT

TAG_RANGE = 1 << 20  # random tags in [1, TAG_RANGE): 0 is what an unwritten page says


@dataclass(frozen=True, slots=True)
class DecodeCheckInputs:
    """check_decode's arguments for one decode step, int32 as the kernel takes them, and the
    slots it must give."""

    pool_state: torch.Tensor  # [4, num_pages]: tags, fill, written tag, tenant
    block_table: torch.Tensor  # [B, M] page ids, padded with 0 past num_held
    held_tags: torch.Tensor  # [B, M] the tags the rows hold them under
    num_held: torch.Tensor  # [B]
    rows: torch.Tensor  # [B] each batch row's table row (here: its own)
    positions: torch.Tensor  # [B] the position each row writes; it reads all before it
    seq_tenant: torch.Tensor  # [B]
    expected_slots: torch.Tensor  # [B] int64: page * page_size + offset of each position
    page_size: int
    scratch_slot: int

    def to(self, device: torch.device) -> "DecodeCheckInputs":
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def arguments(self) -> tuple[torch.Tensor, ...]:
        """The kernel's positional arguments, in its order."""
        return (
            self.pool_state,
            self.block_table,
            self.held_tags,
            self.num_held,
            self.rows,
            self.positions,
            self.seq_tenant,
        )


def decode_check_inputs(
    prompt_tokens: list[int], new_tokens: int, num_pages: int, page_size: int, seed: int = 0
) -> DecodeCheckInputs:
    """The pool state of the last decode step of a batch of these prompts (module docstring);
    ValueError if the pool cannot hold them all."""
    lengths = torch.tensor([p + new_tokens for p in prompt_tokens])
    held = (lengths + page_size - 1) // page_size
    if int(held.sum()) > num_pages:
        raise ValueError(f"{int(held.sum())} pages do not fit a pool of {num_pages}")
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_pages, generator=gen)
    tags = torch.randint(1, TAG_RANGE, (num_pages,), generator=gen)
    fill = torch.zeros(num_pages, dtype=torch.int64)
    written = torch.zeros(num_pages, dtype=torch.int64)
    positions = lengths - 1
    width = int(held.max())
    table = torch.zeros(len(prompt_tokens), width, dtype=torch.int64)
    columns = torch.arange(width)
    start = 0
    for row, count in enumerate(held.tolist()):
        pages = order[start : start + count]
        start += count
        table[row, :count] = pages
        need = (positions[row] - columns[:count] * page_size).clamp(0, page_size)
        fill[pages] = need
        written[pages] = torch.where(need > 0, tags[pages], 0)
    held_tags = torch.where(columns[None, :] < held[:, None], tags[table], 0)
    rows = torch.arange(len(prompt_tokens))
    write_pages = table[rows, positions // page_size]
    state = torch.stack([tags, fill, written, torch.full_like(tags, NO_TENANT)])
    return DecodeCheckInputs(
        pool_state=state.int(),
        block_table=table.int(),
        held_tags=held_tags.int(),
        num_held=held.int(),
        rows=rows.int(),
        positions=positions.int(),
        seq_tenant=torch.zeros(len(prompt_tokens), dtype=torch.int32),
        expected_slots=write_pages * page_size + positions % page_size,
        page_size=page_size,
        scratch_slot=num_pages * page_size,  # past every page a request can hold
    )


def time_check_decode(
    check_decode: Callable[..., None], do_bench: Callable[..., float], inputs: DecodeCheckInputs
) -> dict[str, Any]:
    """One checked call (every row must pass, with its own slot), then the median time of one
    call in milliseconds as do_bench measures it."""
    batch = inputs.rows.shape[0]
    device = inputs.rows.device
    verdict = torch.empty(batch, dtype=torch.int32, device=device)
    slots = torch.empty(batch, dtype=torch.int64, device=device)

    def call() -> None:
        check_decode(
            *inputs.arguments(),
            page_size=inputs.page_size,
            scratch_slot=inputs.scratch_slot,
            verdict=verdict,
            slots=slots,
        )

    call()
    return {
        "rows": batch,
        "pages_per_row_max": inputs.block_table.shape[1],
        "rows_failed": int((verdict != 0).sum()),
        "slots_wrong": int((slots != inputs.expected_slots).sum()),
        "check_ms": float(do_bench(call, return_mode="median")),
    }
