"""A decoder-only transformer over the paged pool: embeddings, a family's layers, the final
norm and the lm_head. What differs by family is the layer (core/families.py), and for Gemma 3
the RoPE its sliding layers rotate by."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvfence_engine.core.attention import StepBatch
from kvfence_engine.core.layers import DecoderLayer, RMSNorm, Weights, fused_linear
from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.rope import Rotary

# a family's layer i, from the config, the weights and i
LayerBuilder = Callable[[ModelConfig, Weights, int], DecoderLayer]
# tensors a checkpoint may hold that change nothing: old checkpoints saved RoPE's frequencies
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class Collectives(Protocol):
    """What a rank's model asks of its tensor-parallel group (parallel/group.TPGroup)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class RankPart:
    """A model that is one rank's part of a tensor-parallel model (core/shards.py): its
    layers' outputs are summed over the ranks, its vocabulary is rows vocab_start.. of the
    embedding and the lm_head, vocab_widths[r] of them on rank r."""

    comm: Collectives
    vocab_start: int
    vocab_widths: tuple[int, ...]
    rank: int

    @property
    def vocab_stop(self) -> int:
        return self.vocab_start + self.vocab_widths[self.rank]


def layer_prefix(i: int) -> str:
    """Where layer i's weights are, by Hugging Face name."""
    return f"model.layers.{i}."


class Decoder(nn.Module):
    """linear_sources: each linear's module path -> the weights it was built from (fused in
    that order), for packing them from the file's own blocks (quantization.pack_int4_linears).
    unit_offset_norm: the final norm's gains are offsets from one (Gemma).
    context: the positions the engine serves (default max_positions), which longrope's
    factors depend on (core/rope.py)."""

    embed_scale: torch.Tensor | None  # a buffer (Gemma)

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        layer: LayerBuilder,
        *,
        unit_offset_norm: bool = False,
        context: int | None = None,
        part: RankPart | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.part = part
        w = Weights(weights, str(config.family))
        self.embed = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)
        # Gemma's embedding scale, in the model's dtype as transformers rounds it (a buffer: the
        # step makes no tensor from a Python number, which a CUDA graph could not capture)
        scale = None if config.embed_scale is None else torch.tensor(config.embed_scale)
        self.register_buffer("embed_scale", scale, persistent=False)
        self.layers = nn.ModuleList(layer(config, w, i) for i in range(config.num_layers))
        if part is not None:
            for built in self.layers:
                assert isinstance(built, DecoderLayer)
                built.reduce = part.comm.all_reduce
        self.norm = RMSNorm(w["model.norm.weight"], config.rms_eps, unit_offset=unit_offset_norm)
        # tied: the embedding table (a tied checkpoint's lm_head.weight, if saved, is a copy
        # transformers ignores too)
        head = "model.embed_tokens" if config.tie_embeddings else "lm_head"
        self.lm_head = fused_linear(w, [head], bias=False)
        self.rotary = Rotary(
            config.head_dim, config.max_positions, config.rope_theta, config.rope, context
        )
        # Gemma 3: the sliding layers rotate by a RoPE of their own
        self.sliding = [config.layer_window(i) is not None for i in range(config.num_layers)]
        self.sliding_rotary: Rotary | None = None
        if config.sliding_rope_theta is not None and any(self.sliding):
            self.sliding_rotary = Rotary(
                config.head_dim,
                config.max_positions,
                config.sliding_rope_theta,
                config.sliding_rope,
                context,
            )
        self.linear_sources = {"lm_head": [head + ".weight"]}
        for i, built in enumerate(self.layers):
            assert isinstance(built, DecoderLayer)
            self.linear_sources |= {f"layers.{i}.{k}": v for k, v in built.sources.items()}
        ignored = {"lm_head.weight"} if config.tie_embeddings else set()
        unknown = [n for n in w.untaken() if n not in ignored and not n.endswith(IGNORED_SUFFIXES)]
        if unknown:
            shown = ", ".join(repr(n) for n in unknown[:4])
            more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
            raise ValueError(
                f"weights: {len(unknown)} tensors the {config.family} model does not use "
                f"({shown}{more}): a part of the model kvfence does not implement"
            )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: StepBatch,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run a flat batch of tokens; returns logits (float32) for the rows in logits_rows."""
        c = self.config
        x = self._embedding(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        rope = self.rotary(positions, x.dtype)
        sliding_rope = (
            rope if self.sliding_rotary is None else self.sliding_rotary(positions, x.dtype)
        )
        for i, layer in enumerate(self.layers):
            x = layer(x, sliding_rope if self.sliding[i] else rope, k_pool[i], v_pool[i], batch)
        logits = self.lm_head(self.norm(x[logits_rows])).float()
        if self.part is not None:  # each rank's vocabulary, side by side
            logits = self.part.comm.gather_columns(logits, list(self.part.vocab_widths))
        if c.logit_softcap is not None:
            logits = torch.tanh(logits / c.logit_softcap) * c.logit_softcap
        return logits

    def _embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's embedding; on a rank, the rows it holds, summed over the ranks (each
        token's row is on exactly one)."""
        if self.part is None:
            return F.embedding(input_ids, self.embed)
        start, stop = self.part.vocab_start, self.part.vocab_stop
        mine = (input_ids >= start) & (input_ids < stop)
        local = torch.where(mine, input_ids - start, 0)
        x = F.embedding(local, self.embed) * mine[:, None].to(self.embed.dtype)
        return self.part.comm.all_reduce(x)
