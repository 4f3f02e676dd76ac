"""The read check: may these sequences attend to the pages in their page tables?

One vectorised function, run once per scheduler step for the whole batch (page tables do not
change inside a step, so checking once per step is as strong as checking once per layer).
"""

from dataclasses import dataclass

import torch

# A sequence's verdict as one code (the device check, core/paged_decode): the first that applies
OK, TAG_MISMATCH, FOREIGN, UNWRITTEN = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class ReadCheck:
    """Per sequence: True where the sequence must fail closed."""

    tag_mismatch: torch.Tensor  # a held page now carries another tag (reallocated under us)
    unwritten: torch.Tensor  # a position to be read was never written for this sequence
    foreign: torch.Tensor  # a held shared (prefix-cache) page belongs to another tenant

    @property
    def failed(self) -> torch.Tensor:
        return self.tag_mismatch | self.unwritten | self.foreign

    @classmethod
    def of_verdicts(cls, verdicts: torch.Tensor) -> "ReadCheck":
        """From one verdict code per sequence (OK, TAG_MISMATCH, FOREIGN, UNWRITTEN)."""
        return cls(
            tag_mismatch=verdicts == TAG_MISMATCH,
            unwritten=verdicts == UNWRITTEN,
            foreign=verdicts == FOREIGN,
        )


def check_reads(
    pool_tags: torch.Tensor,
    pool_fill: torch.Tensor,
    pool_written_tag: torch.Tensor,
    page_table: torch.Tensor,
    held_tags: torch.Tensor,
    num_held: torch.Tensor,
    read_len: torch.Tensor,
    page_size: int,
    pool_tenant: torch.Tensor | None = None,
    seq_tenant: torch.Tensor | None = None,
) -> ReadCheck:
    """Check a batch of page tables against the pool's current tags and fill counts.

    page_table, held_tags: [B, M] page ids and the tags the sequences were given at allocation;
        columns at or beyond num_held[b] are padding and are ignored.
    read_len: [B] how many leading positions each sequence reads from the pool this step; every
        one of them must already have been written (fill) into a page the sequence still owns,
        under the tag the sequence holds (pool_written_tag), not by an earlier owner.
    Every held page is tag-checked, including pages this step will only write into.
    pool_tenant, seq_tenant: the tenant id of each pool page (page_book.NO_TENANT unless it is a
        shared prefix-cache page) and of each sequence [B]: a sequence holding a shared page of
        another tenant fails (a key that should have kept the tenants apart did not).
    """
    cols = torch.arange(page_table.shape[1])
    held = cols[None, :] < num_held[:, None]
    tag_bad = ((pool_tags[page_table] != held_tags) & held).any(dim=1)
    need = (read_len[:, None] - cols[None, :] * page_size).clamp(0, page_size)
    short = ((pool_fill[page_table] < need) | (pool_written_tag[page_table] != held_tags)) & held
    short &= need > 0
    beyond_table = read_len > num_held * page_size  # positions no page was reserved for
    foreign = torch.zeros_like(tag_bad)
    if pool_tenant is not None and seq_tenant is not None:
        owners = pool_tenant[page_table]
        foreign = ((owners >= 0) & (owners != seq_tenant[:, None]) & held).any(dim=1) & ~tag_bad
    unwritten = (short.any(dim=1) | beyond_table) & ~tag_bad & ~foreign
    return ReadCheck(tag_mismatch=tag_bad, unwritten=unwritten, foreign=foreign)
