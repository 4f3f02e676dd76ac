"""One model definition per family, built of the shared layers (core/layers.py) in the
family's own weight names: what each family's checkpoints say about its layer, and nothing else
(the config fields each family accepts: loading/hf_config.py)."""

import torch

from kvfence_engine.core.attention import Scoring
from kvfence_engine.core.decoder import Decoder, LayerBuilder, RankPart, layer_prefix
from kvfence_engine.core.layers import (
    SEPARATE_GATE_UP,
    SEPARATE_QKV,
    DecoderLayer,
    GatedMLP,
    PagedSelfAttention,
    SparseMoE,
    Weights,
)
from kvfence_engine.core.model_config import Family, ModelConfig


def _layer(
    c: ModelConfig,
    w: Weights,
    i: int,
    *,
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool = False,
    qk_norm: bool = False,
    sandwich: bool = False,
    mlp: GatedMLP | SparseMoE | None = None,  # None: the dense gated MLP
    stored_fused: bool = False,
) -> DecoderLayer:
    prefix = layer_prefix(i)
    attn = PagedSelfAttention(
        w,
        prefix + "self_attn.",
        (c.num_heads, c.num_kv_heads, c.head_dim),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm_eps=c.rms_eps if qk_norm else None,
        qk_norm_unit_offset=c.family in UNIT_OFFSET_NORMS,
        scoring=Scoring(c.layer_window(i), c.query_scale, c.attn_softcap),
        qkv_names=("qkv_proj",) if stored_fused else SEPARATE_QKV,
    )
    if mlp is None:
        mlp = GatedMLP(
            w,
            prefix + "mlp.",
            bias=mlp_bias,
            activation=c.activation,
            gate_up_names=("gate_up_proj",) if stored_fused else SEPARATE_GATE_UP,
        )
    return DecoderLayer(w, prefix, c.rms_eps, attn, mlp, sandwich=sandwich)


def llama(c: ModelConfig, w: Weights, i: int) -> DecoderLayer:
    """Llama 2 and 3.x, and Mistral (its sliding window): attention_bias is a bias on q, k, v
    and o; mlp_bias one on gate, up and down."""
    bias = c.attention_bias
    return _layer(c, w, i, qkv_bias=bias, o_bias=bias, mlp_bias=c.mlp_bias)


def qwen2(c: ModelConfig, w: Weights, i: int) -> DecoderLayer:
    """Qwen2 and Qwen2.5: a bias on q, k and v always, none on o or the MLP."""
    return _layer(c, w, i, qkv_bias=True, o_bias=False)


def qwen3(c: ModelConfig, w: Weights, i: int) -> DecoderLayer:
    """Qwen3 dense: an RMSNorm over each head of q and of k (q_norm, k_norm: one gain per head
    dim, rms_norm_eps) before RoPE; attention_bias is a bias on q, k, v and o."""
    bias = c.attention_bias
    return _layer(c, w, i, qkv_bias=bias, o_bias=bias, qk_norm=True)


def qwen3_moe(c: ModelConfig, w: Weights, i: int) -> DecoderLayer:
    """Qwen3-MoE: Qwen3's attention; the MLP of a sparse layer (ModelConfig.layer_is_sparse)
    is routed experts (mlp.gate, mlp.experts.{e}.gate_proj/up_proj/down_proj, as Hub
    checkpoints and transformers' save_pretrained name them), of any other a dense one."""
    mlp = None
    if c.layer_is_sparse(i):
        mlp = SparseMoE(
            w,
            layer_prefix(i) + "mlp.",
            num_experts=c.num_experts,
            top_k=c.experts_per_token,
            norm_topk_prob=c.norm_topk_prob,
            activation=c.activation,
        )
    bias = c.attention_bias
    return _layer(c, w, i, qkv_bias=bias, o_bias=bias, qk_norm=True, mlp=mlp)


def gemma2(c: ModelConfig, w: Weights, i: int) -> DecoderLayer:
    """Gemma 2: sandwich norms with gains as offsets from one, GeGLU, attention scaled by
    query_pre_attn_scalar and soft-capped; sliding and global layers alternate (layer_types).
    The embedding scale, the final norm and the logit soft-cap: Decoder."""
    bias = c.attention_bias
    return _layer(c, w, i, qkv_bias=bias, o_bias=bias, sandwich=True)


def gemma3(c: ModelConfig, w: Weights, i: int) -> DecoderLayer:
    """Gemma 3 text: Gemma 2's layer with an RMSNorm over each head of q and of k before RoPE
    (its gains offsets from one too); sliding layers rotate by their own RoPE (Decoder)."""
    bias = c.attention_bias
    return _layer(c, w, i, qkv_bias=bias, o_bias=bias, qk_norm=True, sandwich=True)


def phi3(c: ModelConfig, w: Weights, i: int) -> DecoderLayer:
    """Phi-3, 3.5 and Phi-4-mini: a Llama without biases whose checkpoints store q, k and v
    stacked in one qkv_proj and gate then up in one gate_up_proj (the very linears the shared
    layers fuse); a sliding window on every layer where sliding_window says so. Partial
    rotary and LongRoPE: core/rope.py."""
    return _layer(c, w, i, qkv_bias=False, o_bias=False, stored_fused=True)


LAYERS: dict[Family, LayerBuilder] = {
    Family.LLAMA: llama,
    Family.QWEN2: qwen2,
    Family.QWEN3: qwen3,
    Family.GEMMA2: gemma2,
    Family.QWEN3_MOE: qwen3_moe,
    Family.GEMMA3: gemma3,
    Family.PHI3: phi3,
}
UNIT_OFFSET_NORMS = {Family.GEMMA2, Family.GEMMA3}


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    context: int | None = None,
    part: RankPart | None = None,
) -> Decoder:
    """The model for an engine that serves `context` positions (default max_positions); with
    `part`, one rank's part of it (config and weights that rank's: core/shards.py)."""
    family = config.family
    return Decoder(
        config,
        weights,
        LAYERS[family],
        unit_offset_norm=family in UNIT_OFFSET_NORMS,
        context=context,
        part=part,
    )
