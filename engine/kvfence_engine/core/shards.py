"""Which part of the model each rank holds, and its share of a checkpoint's tensors (pure: no
process group).

- Attention: whole KV heads per rank, with the query heads of their groups, so that each rank
  attends on its own (no communication inside attention). The KV heads are split as evenly as
  they go (SmolLM2's 3 over 2 ranks: 2 and 1, its 9 query heads 6 and 3); with fewer KV heads
  than ranks, each is replicated over world / kv ranks, which split its group of query heads.
  q/k/v rows (and biases) are column-parallel; o_proj's columns row-parallel, its output summed
  over the ranks (one all-reduce).
- MLP: gate/up rows and down's columns split as evenly as they go, one all-reduce after down.
  A MoE's experts are split the same way, each expert on every rank (its router replicated, so
  every rank routes a token alike), one all-reduce after the layer's experts.
- Vocabulary: the embedding's rows (and the lm_head's, tied or not) split as evenly as they go;
  an embedding lookup is summed over the ranks, the logits gathered.
- A bias added after a sum (o_proj's, down's) is rank 0's; the others hold zeros.
- Norms, the router and everything else: replicated.

Pure, without torch (`kvfence preflight` sizes a rank's pool with it); a checkpoint's tensors
are split by core/shard_weights.py.
"""

from dataclasses import dataclass, replace

from kvfence_engine.core.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class Span:
    """[start, stop) of one dimension."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def even_spans(total: int, parts: int) -> list[Span]:
    """`total` split into `parts` contiguous spans as even as they go (the first ones larger),
    torch.tensor_split's rule."""
    base, extra = divmod(total, parts)
    spans, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        spans.append(Span(start, start + size))
        start += size
    return spans


@dataclass(frozen=True, slots=True)
class RankShard:
    """What rank `rank` of `world` holds: query heads, KV heads, vocabulary rows, and the span
    of an MLP's hidden units (intermediate_size or an expert's) by their count."""

    rank: int
    world: int
    q_heads: Span
    kv_heads: Span
    vocab: Span

    def hidden(self, intermediate: int) -> Span:
        return even_spans(intermediate, self.world)[self.rank]

    @property
    def adds_biases(self) -> bool:
        """Whether this rank adds the biases that follow a sum over the ranks."""
        return self.rank == 0


def plan_shards(config: ModelConfig, world: int) -> list[RankShard]:
    """Each rank's part, or ValueError naming why the model does not split over `world`."""
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {world}")
    heads, kv = config.num_heads, config.num_kv_heads
    group = heads // kv
    if world > heads:
        raise ValueError(
            f"--tensor-parallel-size {world}: the model has {heads} attention heads, fewer "
            "than the ranks"
        )
    if world > config.vocab_size:
        raise ValueError(f"--tensor-parallel-size {world} exceeds the vocabulary")
    vocab = even_spans(config.vocab_size, world)
    if kv >= world:
        kv_spans = even_spans(kv, world)
        q_spans = [Span(s.start * group, s.stop * group) for s in kv_spans]
    else:
        if world % kv:
            raise ValueError(
                f"--tensor-parallel-size {world}: the model's {kv} KV heads are fewer than the "
                f"ranks, and the ranks are not a multiple of them (each KV head is replicated "
                f"over an equal number of ranks)"
            )
        copies = world // kv  # at most the group's query heads: world <= heads
        kv_spans, q_spans = [], []
        for rank in range(world):
            head, part = divmod(rank, copies)
            kv_spans.append(Span(head, head + 1))
            share = even_spans(group, copies)[part]
            q_spans.append(Span(head * group + share.start, head * group + share.stop))
    return [RankShard(r, world, q_spans[r], kv_spans[r], vocab[r]) for r in range(world)]


def rank_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The config a rank's layers are built from: its query and KV heads."""
    return replace(config, num_heads=shard.q_heads.size, num_kv_heads=shard.kv_heads.size)


def pool_shape(config: ModelConfig, world: int) -> ModelConfig:
    """The config whose KV heads size one rank's pool: every rank has as many pages, so each
    is sized for the rank with the most KV heads (the others' pools are that many pages too)."""
    if world == 1:
        return config
    widest = max(plan_shards(config, world), key=lambda s: s.kv_heads.size)
    return rank_config(config, widest)
