"""The pages' keys and values: two tensors [layers, pages, page_size, kv_heads, head_dim] on the
device. What a page holds, never who may read it: that is the bookkeeping in core/page_book,
and both are reached through core/page_manager.

With `scratch_page`, one page more than num_pages is allocated, which no request is ever given:
where a device decode step (core/device_decode) sends the writes of a row that failed its read
check.

With tensor parallelism a rank's pool holds its KV heads only (`heads`: which of the model's
`total_heads`); a transferred page is the model's whole page, of which `write` keeps this
rank's heads (core/shards.py). What `export` copies out is this rank's heads too: rank 0 joins
the ranks' parts (core/leader.py).
"""

import torch


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scratch_page: bool = False,
        heads: tuple[int, int] | None = None,  # [start, stop) of total_heads; None: all
        total_heads: int | None = None,
    ) -> None:
        assert num_pages > 0 and page_size > 0
        shape = (num_layers, num_pages + scratch_page, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size
        self.scratch_slot = num_pages * page_size if scratch_page else None
        self.heads = heads or (0, num_kv_heads)
        self.total_heads = total_heads or num_kv_heads
        assert self.heads[1] - self.heads[0] == num_kv_heads <= self.total_heads

    def scrub(self, pages: list[int]) -> None:
        """Zero pages' keys and values (--scrub-on-free)."""
        idx = torch.tensor(pages)
        self.k[:, idx] = 0
        self.v[:, idx] = 0

    def write(self, page: int, tokens: int, payload: memoryview) -> None:
        """Write a transferred page: its K then its V bytes, a full page of every KV head of
        the model, of which the first `tokens` slots are valid (and this pool's heads kept)."""
        layers, _, page_size, _, head_dim = self.k.shape
        shape = (layers, page_size, self.total_heads, head_dim)
        flat = torch.frombuffer(payload, dtype=self.k.dtype)
        half = flat.numel() // 2
        start, stop = self.heads
        for pool, part in ((self.k, flat[:half]), (self.v, flat[half:])):
            pool[:, page, :tokens] = part.view(shape)[:, :tokens, start:stop].to(pool.device)

    def export(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy pages out as host tensors [pages, layers, page_size, heads, dim]."""
        idx = torch.tensor(pages, device=self.k.device)
        k = self.k.index_select(1, idx).transpose(0, 1).contiguous().cpu()
        v = self.v.index_select(1, idx).transpose(0, 1).contiguous().cpu()
        return k, v
