"""A GGUF file's model metadata, strictly: every key of the architecture's namespace (`llama.`,
`qwen2.`, `qwen3.`) is one kvfence implements or a refusal that names it, and so is every tensor
(hf_name). RoPE scaling: `none` and `linear` (llama.cpp's freq_scale = 1 / factor on
positions is transformers' linear: frequencies / factor); YaRN is refused, since llama.cpp's
attn_factor and ext_factor do not mean what transformers' yarn parameters do, and nothing here
checks llama.cpp's against a reference. A `rope_freqs.weight` tensor (how llama.cpp's
converter writes Llama 3.1's llama3 scaling: one factor per frequency, which ggml's rope
divides it by) is read into the config, not the weights: frequencies / factors, which for the
factors that converter computes is transformers' llama3 (test_model_families.py)."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvfence_engine.core.model_config import Family, ModelConfig, RopeScaling, RopeType
from kvfence_engine.loading.tokenizer_source import gguf_fields

FAMILIES = {"llama": Family.LLAMA, "qwen2": Family.QWEN2, "qwen3": Family.QWEN3}
# the architecture's keys kvfence reads (prefixed with "<arch>.")
KEYS = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "vocab_size",  # the tokenizer's token list is what sizes the embedding
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    # what a scaled model was fine-tuned on and from: provenance, not computation
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
}

# must be given (the rest have defaults: kv heads = heads, head dim = width / heads, ...)
REQUIRED = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
}


_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3's per-head q/k norms
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # RoPE's per-frequency factors: the config's, not a weight


def hf_name(gguf_name: str) -> str:
    """A GGUF tensor's Hugging Face name; a tensor kvfence has no place for is refused."""
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_PARTS:
        _, layer, part, kind = parts
        return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{kind}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} is not one kvfence implements (it may change the computation)"
    )


def gguf_config(reader: Any, path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The shape from GGUF metadata, and the metadata itself (the tokenizer lives there)."""
    fields = gguf_fields(reader)
    arch = fields["general.architecture"]
    if arch not in FAMILIES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported by kvfence "
            f"(supported: {', '.join(FAMILIES)})"
        )
    if int(fields.get("split.count", 1)) > 1:
        raise ValueError(
            f"{path}: a split GGUF ({fields['split.count']} files) is not supported "
            "by kvfence; merge it (llama-gguf-split --merge)"
        )

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None and key in REQUIRED:
            raise ValueError(f"{path}: GGUF key '{arch}.{key}' is missing")
        return value

    rope = _rope_scaling(arch, get, path)  # first: a scaling type names itself best
    for key, value in fields.items():
        if key.startswith(arch + ".") and key.removeprefix(arch + ".") not in KEYS:
            raise ValueError(
                f"{path}: GGUF key {key!r}={value!r} is not one kvfence "
                "implements; it may change the computation"
            )

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    for key in ("attention.value_length", "rope.dimension_count"):
        if int(get(key, head_dim)) != head_dim:
            raise ValueError(
                f"{path}: GGUF key '{arch}.{key}'={get(key)} is not the head dim "
                f"{head_dim} and is not implemented"
            )
    tensor_names = {t.name for t in reader.tensors}
    for name in sorted(tensor_names - {ROPE_FREQS}):
        try:
            hf_name(name)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        rope = _freq_factors(np.asarray(freqs.data, dtype=np.float32), rope, head_dim, path)
    config = ModelConfig(
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_positions=int(get("context_length")),
        tie_embeddings="output.weight" not in tensor_names,
        # llama and qwen3: optional biases on q, k, v and o; qwen2: on q, k, v always
        attention_bias=arch in ("llama", "qwen3") and "blk.0.attn_q.bias" in tensor_names,
        family=FAMILIES[arch],
        rope=rope,
    )
    return config, fields


def _rope_scaling(arch: str, get: Callable[..., Any], path: Path) -> RopeScaling:
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        factor = get("rope.scaling.factor")
        if factor is None:
            raise ValueError(
                f"{path}: GGUF rope scaling type 'linear' without '{arch}.rope.scaling.factor'"
            )
        return RopeScaling(type=RopeType.LINEAR, factor=float(factor))
    raise ValueError(
        f"{path}: GGUF rope scaling type {kind!r} ('{arch}.rope.scaling.type') is "
        "not supported by kvfence (supported: none, linear)"
    )


def _freq_factors(values: np.ndarray, rope: RopeScaling, head_dim: int, path: Path) -> RopeScaling:
    """rope_freqs.weight: one positive factor per rotated frequency, and no other scaling."""
    if rope.type is not RopeType.DEFAULT:
        raise ValueError(
            f"{path}: GGUF tensor '{ROPE_FREQS}' beside rope scaling type '{rope.type}' is "
            "not supported by kvfence (llama.cpp would apply both)"
        )
    factors = values.reshape(-1)
    if factors.size != head_dim // 2 or not bool(np.all(np.isfinite(factors) & (factors > 0))):
        raise ValueError(
            f"{path}: GGUF tensor '{ROPE_FREQS}' holds {factors.size} factors; kvfence needs "
            f"{head_dim // 2} (one per rotated frequency of head dim {head_dim}), each positive"
        )
    return RopeScaling(type=RopeType.FREQ_FACTORS, freq_factors=tuple(factors.tolist()))
