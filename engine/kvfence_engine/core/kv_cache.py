"""The pages' keys and values: two tensors [layers, pages, page_size, kv_heads, head_dim] on the
device. What a page holds, never who may read it: that is the bookkeeping in core/page_book,
and both are reached through core/page_manager.

With `scratch_page`, one page more than num_pages is allocated, which no request is ever given:
where a device decode step (core/device_decode) sends the writes of a row that failed its read
check.
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
    ) -> None:
        assert num_pages > 0 and page_size > 0
        shape = (num_layers, num_pages + scratch_page, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size
        self.scratch_slot = num_pages * page_size if scratch_page else None

    def scrub(self, pages: list[int]) -> None:
        """Zero pages' keys and values (--scrub-on-free)."""
        idx = torch.tensor(pages)
        self.k[:, idx] = 0
        self.v[:, idx] = 0

    def write(self, page: int, tokens: int, payload: memoryview) -> None:
        """Write a transferred page: its K then its V bytes, a full page of which the first
        `tokens` slots are valid."""
        shape = self.k[:, page].shape
        flat = torch.frombuffer(payload, dtype=self.k.dtype)
        half = flat.numel() // 2
        self.k[:, page, :tokens] = flat[:half].view(shape)[:, :tokens].to(self.k.device)
        self.v[:, page, :tokens] = flat[half:].view(shape)[:, :tokens].to(self.v.device)

    def export(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy pages out as host tensors [pages, layers, page_size, heads, dim]."""
        idx = torch.tensor(pages, device=self.k.device)
        k = self.k.index_select(1, idx).transpose(0, 1).contiguous().cpu()
        v = self.v.index_select(1, idx).transpose(0, 1).contiguous().cpu()
        return k, v
