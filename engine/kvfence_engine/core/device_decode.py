"""Decode steps on a CUDA device, with nothing rebuilt from Python lists on the host per step.

What lives on the device, updated incrementally:
- the read check's pool state (each page's tag, fill, written tag, tenant): copied whole once,
  then only the pages the page book reports changed (PageManager.take_changes) before a step;
- a page table per running request (its pages and the tags it holds them under), in a row of
  its own: a row is copied when the request's table is new (Request.table_epoch) and grown by
  the pages appended since;
- each step's inputs (token, position, table row, tenant per batch row): one copy.

A step is one CUDA graph per batch-size bucket, captured at start: the read check
(paged_decode.check_decode) over every page each row holds, the model with paged decode
attention that reads only the pages a row attends to and nothing for a row that failed, then
greedy argmax. Rows that sample are drawn after it, on the device too (core/device_sampler),
and the logprobs rows ask for are computed there: only token ids, verdicts and those few
numbers per row come back. A row beyond the batch in its bucket is a padding row whose table
is empty: it fails the check and reads nothing.

core/runner.py + core/isolation.py stay the path for prefill and for every CPU step.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence_engine.core import device_sampler as sampler
from kvfence_engine.core.attention import Scoring, StepBatch
from kvfence_engine.core.decoder import Decoder
from kvfence_engine.core.device_sampler import SamplingRows
from kvfence_engine.core.isolation import ReadCheck
from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.page_manager import PageManager
from kvfence_engine.core.request import Request, TokenLogprob

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512)
INPUTS = 4  # rows of the step's input: token, position, table row, tenant


def unsupported(config: ModelConfig) -> str | None:
    """Why decode cannot run as device kernels for this model (None: it can)."""
    if any(config.layer_is_sparse(i) for i in range(config.num_layers)):
        return "a mixture-of-experts layer routes tokens with host-side decisions"
    return None


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """Per batch row: its token, the read check's verdict (paged_decode.OK or why it failed)
    and the logprobs it asked for (None where it asked none)."""

    tokens: list[int]
    verdicts: list[int]
    logprobs: list[TokenLogprob | None]

    def read_check(self) -> ReadCheck:
        return ReadCheck.of_verdicts(torch.tensor(self.verdicts))


@dataclass(slots=True)
class _Row:
    index: int  # in the device tables
    epoch: int  # the request's table_epoch when copied
    synced: int  # leading pages of the request's table copied into the row


class DeviceDecoder:
    def __init__(
        self,
        model: Decoder,
        pages: PageManager,
        *,
        max_seqs: int,
        table_tokens: int,
        check: bool,
        graphs: bool,
    ) -> None:
        from kvfence_engine.core import paged_decode  # triton: imported on a GPU only

        self._kernels = paged_decode
        self.model = model
        self.pages = pages
        config = model.config
        device = next(model.parameters()).device
        self.device = device
        kv = pages.kv
        assert kv.scratch_slot is not None, "the pool needs its scratch page"
        self.scratch_slot = kv.scratch_slot
        self.page_size = pages.page_size
        self.check = check
        width = self.width = -(-table_tokens // self.page_size)
        self.max_seqs = max_seqs
        self.pad_row = max_seqs  # its table is empty: a padding row fails the check
        i32 = torch.int32
        self.tables = torch.zeros(2, max_seqs + 1, width, dtype=i32, device=device)  # + tags
        self.num_held = torch.zeros(max_seqs + 1, dtype=i32, device=device)
        self.state = pages.track_state().to(device)
        self.buckets = [b for b in BUCKETS if b < max_seqs] + [max_seqs]
        top = self.buckets[-1]
        self.inputs = torch.zeros(INPUTS, top, dtype=i32, device=device)
        self._host_inputs = torch.zeros(INPUTS, top, dtype=torch.int32)
        if device.type == "cuda":
            self._host_inputs = self._host_inputs.pin_memory()
        self.verdict = torch.zeros(top, dtype=i32, device=device)
        self.slots = torch.zeros(top, dtype=torch.int64, device=device)
        self.all_rows = torch.arange(top, device=device)
        self.out = torch.zeros(2, top, dtype=torch.int64, device=device)  # tokens, verdicts
        self.logits: dict[int, torch.Tensor] = {}
        self.rows: dict[int, _Row] = {}
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self.processors = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1  # the kernels on CPU tensors: Triton's interpreter, in tests
        )
        self.head_dim = config.head_dim
        self._parts: dict[int, tuple[int, tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if graphs and device.type == "cuda":
            self._capture()

    # --- the step's body: what a graph captures -----------------------------------------------

    def _scratch(self, bucket: int) -> tuple[int, tuple[torch.Tensor, torch.Tensor] | None]:
        """The split of each row's keys for this bucket, and its float32 buffers (static)."""
        if bucket not in self._parts:
            c = self.model.config
            parts = self._kernels.decode_parts(bucket, c.num_kv_heads, self.processors)
            buffers = None
            if parts > 1:
                shapes = ((bucket, c.num_heads, parts, c.head_dim), (2, bucket, c.num_heads, parts))
                acc, ml = (torch.empty(s, dtype=torch.float32, device=self.device) for s in shapes)
                buffers = (acc, ml)
            self._parts[bucket] = (parts, buffers)
        return self._parts[bucket]

    def _body(self, bucket: int) -> None:
        kernels = self._kernels
        ids, positions, rows, tenants = self.inputs[:, :bucket]
        verdict, slots = self.verdict[:bucket], self.slots[:bucket]
        kernels.check_decode(
            self.state,
            self.tables[0],
            self.tables[1],
            self.num_held,
            rows,
            positions,
            tenants,
            page_size=self.page_size,
            scratch_slot=self.scratch_slot,
            verdict=verdict,
            slots=slots,
            check=self.check,
        )
        parts, buffers = self._scratch(bucket)
        default_scale = self.head_dim**-0.5

        def attend(
            q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scoring: Scoring
        ) -> torch.Tensor:
            return kernels.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                self.tables[0],
                rows,
                positions,
                verdict,
                scale=scoring.scale if scoring.scale is not None else default_scale,
                softcap=scoring.softcap,
                window=scoring.window,
                parts=parts,
                scratch=buffers,
            )

        batch = StepBatch(is_prefill=False, slot_mapping=slots, cu_seqlens=[], device_attend=attend)
        kv = self.pages.kv
        logits = self.model(ids.long(), positions.long(), batch, kv.k, kv.v, self.all_rows[:bucket])
        self.logits[bucket] = logits
        self.out[0, :bucket] = logits.argmax(dim=-1)
        self.out[1, :bucket] = verdict

    def _capture(self) -> None:
        """One graph per bucket, largest first (the others reuse its memory). Each body runs
        once before its capture: Triton compiles, cuBLAS picks its kernels."""
        self._set_padding(self.buckets[-1])
        pool = None
        stream = torch.cuda.Stream(self.device)
        for bucket in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._body(bucket)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._body(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    def _set_padding(self, count: int) -> None:
        host = self._host_inputs
        host[:, :count] = 0
        host[2, :count] = self.pad_row
        self.inputs[:, :count].copy_(host[:, :count])

    # --- a step -------------------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def step(self, seqs: Sequence[Request]) -> DecodeResult:
        """One decode step of `seqs` (at most max_seqs): each writes its position
        num_tokens - 1 and attends to every earlier one. The pages it will write were
        allocated (the scheduler's may_append)."""
        batch = len(seqs)
        bucket = self.bucket_for(batch)
        self._sync_state()
        rows = self._sync_tables(seqs)
        host = self._host_inputs
        host[:, :bucket] = 0
        host[2, :bucket] = self.pad_row
        host[:, :batch] = torch.tensor(
            [
                [s.last_token for s in seqs],
                [s.num_tokens - 1 for s in seqs],
                rows,
                [self.pages.tenant_id(s.tenant) for s in seqs],
            ],
            dtype=torch.int32,
        )
        self.inputs.copy_(host, non_blocking=True)  # whole: one contiguous copy of a few KiB
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._body(bucket)
        return self._choose(seqs, self.logits[bucket][:batch])

    def _choose(self, seqs: Sequence[Request], logits: torch.Tensor) -> DecodeResult:
        """The batch's tokens and the logprobs its rows ask for, drawn from the step's logits
        where they are; one copy of ids and one of numbers comes back."""
        batch = len(seqs)
        ids = self.out[:, :batch]  # the graph's argmax, the check's verdicts
        sampled = [not s.params.greedy for s in seqs]
        if any(sampled):
            params = [s.params for s in seqs]
            rows = SamplingRows(
                temperature=self._to_device(
                    [0.0 if p.greedy else p.temperature for p in params], torch.float32
                ),
                top_k=self._to_device([p.top_k for p in params], torch.int64),
                top_p=self._to_device([p.top_p for p in params], torch.float32),
                seed=self._to_device([s.seed for s in seqs], torch.int64),
                position=self._to_device([s.num_tokens for s in seqs], torch.int64),
            )
            finite = torch.isfinite(logits).all(dim=-1) | (rows.temperature == 0)
            ids = torch.cat([sampler.sample(logits, rows)[None], ids[1:], (~finite).long()[None]])
        vocab = logits.shape[-1]
        tops = [None if s.params.logprobs is None else min(s.params.logprobs, vocab) for s in seqs]
        wanted = [n for n in tops if n is not None]
        numbers = None
        if wanted:
            chosen, values, top_ids = sampler.logprobs(logits, ids[0], max(wanted))
            ids = torch.cat([ids, top_ids.T])
            numbers = torch.cat([chosen[None], values.T]).cpu()
        host = ids.cpu()
        tokens = host[0].tolist()
        if any(sampled) and bool(host[2].any()):
            raise ValueError("the model's logits are not finite: nothing to sample from")
        logprobs: list[TokenLogprob | None] = [None] * batch
        if numbers is not None:
            first_top = 3 if any(sampled) else 2
            for b, n in enumerate(tops):
                if n is None:
                    continue
                top = tuple(
                    zip(
                        host[first_top : first_top + n, b].tolist(),
                        numbers[1 : 1 + n, b].tolist(),
                        strict=True,
                    )
                )
                logprobs[b] = TokenLogprob(tokens[b], float(numbers[0, b]), top)
        return DecodeResult(tokens, host[1].tolist(), logprobs)

    def _to_device(self, values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _sync_state(self) -> None:
        changes = self.pages.take_changes()
        if changes is not None:
            pages, values = changes
            self.state[:, pages.to(self.device)] = values.to(self.device)

    def _sync_tables(self, seqs: Sequence[Request]) -> list[int]:
        """Each request's table row, with what changed in its page table copied there."""
        rows, cells, held = [], [], []
        for seq in seqs:
            state = self._row(seq, seqs)
            row = state.index
            count = len(seq.pages)
            if count > self.width:
                raise ValueError(f"seq {seq.seq_id} holds {count} pages, over {self.width}")
            if state.epoch != seq.table_epoch:
                state.epoch, state.synced = seq.table_epoch, 0
            if count != state.synced:
                for col in range(state.synced, count):
                    cells.append((row, col, seq.pages[col], seq.page_tags[col]))
                held.append((row, count))
                state.synced = count
            rows.append(row)
        if cells:
            r, c, page, tag = torch.tensor(cells, dtype=torch.int64).to(self.device).unbind(1)
            self.tables[:, r, c] = torch.stack([page, tag]).to(torch.int32)
        if held:
            at, counts = torch.tensor(held, dtype=torch.int64).to(self.device).unbind(1)
            self.num_held[at] = counts.to(torch.int32)
        return rows

    def _row(self, seq: Request, batch: Sequence[Request]) -> _Row:
        """The request's table row; a new one from the free rows, which first take back the
        rows of requests that are not in this batch when none is left."""
        state = self.rows.get(seq.seq_id)
        if state is None:
            if not self._free_rows:
                live = {s.seq_id for s in batch}
                for seq_id in [i for i in self.rows if i not in live]:
                    self._free_rows.append(self.rows.pop(seq_id).index)
            state = self.rows[seq.seq_id] = _Row(self._free_rows.pop(), epoch=-1, synced=0)
        return state
