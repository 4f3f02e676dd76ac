"""Turns a scheduled batch into tensors, and runs the model over the pool."""

from dataclasses import dataclass, field, fields, replace

import torch

from kvfence_engine.core.attention import StepBatch
from kvfence_engine.core.decoder import Decoder
from kvfence_engine.core.faults import Faults
from kvfence_engine.core.isolation import ReadCheck, check_reads
from kvfence_engine.core.page_book import PageBook
from kvfence_engine.core.page_manager import PageManager, export_pages
from kvfence_engine.core.request import Request


@dataclass(slots=True)
class PreparedStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: StepBatch
    logits_rows: torch.Tensor
    # what the read check needs, on the host
    page_table: torch.Tensor
    held_tags: torch.Tensor
    num_held: torch.Tensor
    read_len: torch.Tensor
    seq_tenant: torch.Tensor  # the pool's id of each sequence's tenant
    # which slots this step writes, for the pool's fill counts
    written_pages: torch.Tensor
    written_offsets: torch.Tensor
    # prefill role: the pages each request of the batch that leaves for decode exports after
    # the step (PageManager.export), in batch order; the other ranks export theirs alike
    exports: list[list[int]] = field(default_factory=list)

    def on(self, device: torch.device) -> "PreparedStep":
        """The step with its batch's tensors on `device` (rank 0 sends it to the other ranks
        of a tensor-parallel group on the host; each runs it on its own device)."""
        batch = self.batch
        moved = {
            f.name: getattr(batch, f.name).to(device)
            for f in fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        }
        assert batch.device_attend is None and not batch.window_masks, "a host-path step"
        return replace(self, batch=replace(batch, **moved))


def check_step(book: PageBook, step: PreparedStep) -> ReadCheck:
    """The read check (core/isolation) of a step's page tables against a pool's bookkeeping."""
    return check_reads(
        book.tags,
        book.fill,
        book.written_tag,
        step.page_table,
        step.held_tags,
        step.num_held,
        step.read_len,
        book.page_size,
        book.page_tenant,
        step.seq_tenant,
    )


def _padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out


class ModelRunner:
    def __init__(
        self, model: Decoder, pages: PageManager, device: torch.device, faults: Faults
    ) -> None:
        self.model = model
        self.pages = pages
        self.device = device
        self.faults = faults

    def prefill_tokens(self, seq: Request) -> list[int]:
        """The tokens a prefill computes: all of them (after preemption, outputs too)."""
        if seq.placeholder_rejection is not None:
            # reject-placeholder fault: the rejected prompt became a one-token placeholder,
            # yet the full length was reserved and will be treated as written.
            return seq.prompt_ids[:1]
        return seq.all_ids()

    def prepare(self, seqs: list[Request], is_prefill: bool) -> PreparedStep:
        page = self.pages.page_size
        page_table = _padded([s.pages for s in seqs])
        held_tags = _padded([s.page_tags for s in seqs])
        num_held = torch.tensor([len(s.pages) for s in seqs], dtype=torch.int64)
        seq_tenant = torch.tensor([self.pages.tenant_id(s.tenant) for s in seqs], dtype=torch.int64)
        if is_prefill:
            # A prefix-cache hit: the first prefill_start tokens are read from shared pages.
            starts = [s.prefill_start for s in seqs]
            chunks = [self.prefill_tokens(s)[a:] for s, a in zip(seqs, starts, strict=True)]
            lengths = [len(c) for c in chunks]
            input_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
            positions = torch.cat(
                [torch.arange(a, a + n) for a, n in zip(starts, lengths, strict=True)]
            )
            owner_row = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lengths))
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            logits_rows = torch.tensor(cu[1:], dtype=torch.int64) - 1
            # reads only what it writes, and the cached prefix
            read_len = torch.tensor(starts, dtype=torch.int64)
            exports = [
                export_pages(self.pages, s, len(self.prefill_tokens(s)))
                for s in seqs
                if s.export_kv
            ]
        else:
            input_ids = torch.tensor([s.last_token for s in seqs], dtype=torch.int64)
            positions = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.int64)
            owner_row = torch.arange(len(seqs))
            cu = []
            logits_rows = torch.arange(len(seqs))
            read_len = positions.clone()  # every earlier position must already be written
            exports = []
        written_pages = page_table[owner_row, positions // page]
        written_offsets = positions % page
        slots = written_pages * page + written_offsets
        batch = StepBatch(is_prefill=is_prefill, slot_mapping=slots.to(self.device), cu_seqlens=cu)
        if is_prefill and any(starts):
            batch.prefix_lens = starts
            batch.page_table = page_table.to(self.device)
        if not is_prefill:
            keys = torch.arange(page_table.shape[1] * page)
            batch.page_table = page_table.to(self.device)
            batch.key_mask = (keys[None, :] <= positions[:, None])[:, None, None, :].to(self.device)
            batch.query_positions = positions.to(self.device)
        return PreparedStep(
            input_ids=input_ids,
            positions=positions,
            batch=batch,
            logits_rows=logits_rows,
            page_table=page_table,
            held_tags=held_tags,
            num_held=num_held,
            read_len=read_len,
            seq_tenant=seq_tenant,
            written_pages=written_pages,
            written_offsets=written_offsets,
            exports=exports,
        )

    def run(self, step: PreparedStep) -> torch.Tensor:
        logits = self.model(
            step.input_ids.to(self.device),
            step.positions.to(self.device),
            step.batch,
            self.pages.kv.k,
            self.pages.kv.v,
            step.logits_rows.to(self.device),
        )
        self.pages.record_writes(step.written_pages, step.written_offsets)
        return logits.cpu()
