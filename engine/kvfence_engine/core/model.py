"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over the paged pool."""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvfence_engine.core.attention import StepBatch, paged_attention
from kvfence_engine.core.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Rotate-half RoPE (Hugging Face layout), cos/sin tables precomputed once."""

    cos: torch.Tensor  # buffers (register_buffer): [max_positions, head_dim]
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeAngles":
        """This step's cos/sin rows, looked up once and shared by every layer."""
        return RopeAngles(
            self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
        )


class RopeAngles(NamedTuple):
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] -> rotated by each token's position."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        attn = prefix + "self_attn."
        qkv_bias = None
        if c.attention_bias:
            qkv_bias = torch.cat([w[attn + f"{p}_proj.bias"] for p in "qkv"])
        self.qkv = _linear(torch.cat([w[attn + f"{p}_proj.weight"] for p in "qkv"]), qkv_bias)
        self.o_proj = _linear(w[attn + "o_proj.weight"])
        mlp = prefix + "mlp."
        self.gate_up = _linear(torch.cat([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]))
        self.down = _linear(w[mlp + "down_proj.weight"])
        self.input_norm = RMSNorm(w[prefix + "input_layernorm.weight"], c.rms_eps)
        self.post_norm = RMSNorm(w[prefix + "post_attention_layernorm.weight"], c.rms_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeAngles,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: StepBatch,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        heads = self.qkv(self.input_norm(x)).view(tokens, -1, self.head_dim)
        qk = rope.rotate(heads[:, : self.num_heads + self.num_kv_heads])  # q and k in one go
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = heads[:, self.num_heads + self.num_kv_heads :]
        attn = paged_attention(q, k, v, k_cache, v_cache, batch)
        x = x + self.o_proj(attn.reshape(tokens, self.q_size))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    """linear_sources: each linear's module path -> the weights it was built from (fused in
    that order), for packing them from the file's own blocks (quantization.pack_int4_linears)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, f"model.layers.{i}.") for i in range(config.num_layers)
        )
        self.norm = RMSNorm(weights["model.norm.weight"], config.rms_eps)
        head = weights.get("lm_head.weight")
        self.lm_head = _linear(self.embed if config.tie_embeddings or head is None else head)
        self.rotary = Rotary(config.head_dim, config.max_positions, config.rope_theta)
        self.linear_sources = {"lm_head": ["lm_head.weight"]}
        if config.tie_embeddings or head is None:
            self.linear_sources["lm_head"] = ["model.embed_tokens.weight"]
        for i in range(config.num_layers):
            w = f"model.layers.{i}."
            self.linear_sources |= {
                f"layers.{i}.qkv": [w + f"self_attn.{p}_proj.weight" for p in "qkv"],
                f"layers.{i}.o_proj": [w + "self_attn.o_proj.weight"],
                f"layers.{i}.gate_up": [w + "mlp.gate_proj.weight", w + "mlp.up_proj.weight"],
                f"layers.{i}.down": [w + "mlp.down_proj.weight"],
            }

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
        x = F.embedding(input_ids, self.embed)
        rope = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, k_pool[i], v_pool[i], batch)
        return self.lm_head(self.norm(x[logits_rows])).float()
