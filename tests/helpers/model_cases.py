"""The tiny models of every family and RoPE variant kvfence serves, as transformers' own config
classes and their overrides (tests/helpers/transformers_reference.hf_model builds them): what
the family tests compare with transformers, and what tensor parallelism is checked on."""

from typing import Any


def rope(kind: str, theta: float = 10000.0, **values: object) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": theta, **values}}


LONG = {"original_max_position_embeddings": 64}
# Phi-3/4's LongRoPE: one factor per rotated pair (head dim 16; Phi-4-mini's 0.75 rotates 12),
# short ones near 1, long ones growing as the hub's do, so that taking one for the other shows
PHI3_PARTIAL = {"partial_rotary_factor": 0.75, "tie_word_embeddings": True}  # Phi-4-mini's


def longrope(pairs: int, original: int) -> dict[str, Any]:
    short = [1.0 + 0.05 * i for i in range(pairs)]
    long = [1.5**i for i in range(pairs)]
    entry = rope("longrope", short_factor=short, long_factor=long)
    return {**entry, "original_max_position_embeddings": original}


LLAMA3 = rope("llama3", 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, **LONG)
MOE = {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
GEMMA3 = {"head_dim": 16, "sliding_window": 24, "sliding_window_pattern": 2}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama-biases": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "llama-linear": ("LlamaConfig", rope("linear", factor=4.0)),
    "llama-dynamic": ("LlamaConfig", rope("dynamic", factor=2.0)),
    "llama-llama3": ("LlamaConfig", LLAMA3),
    "llama-llama3-tied": ("LlamaConfig", {**LLAMA3, "tie_word_embeddings": True}),
    "llama-yarn": ("LlamaConfig", rope("yarn", factor=4.0, **LONG)),
    "llama-yarn-attention-factor": (
        "LlamaConfig",
        rope("yarn", factor=4.0, attention_factor=1.3, beta_fast=16.0, beta_slow=2.0, **LONG),
    ),
    "llama-yarn-mscale": (
        "LlamaConfig",
        rope("yarn", factor=8.0, mscale=1.0, mscale_all_dim=0.5, truncate=False, **LONG),
    ),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2-yarn": ("Qwen2Config", rope("yarn", 1000000.0, factor=4.0, **LONG)),
    # head_dim 32, not hidden / heads = 16: Qwen3's is its own
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "qwen3-tied-biases": (
        "Qwen3Config",
        {"head_dim": 32, "tie_word_embeddings": True, "attention_bias": True},
    ),
    "mistral-no-window": ("MistralConfig", {"sliding_window": None}),
    # a window no shorter than the served context changes nothing
    "mistral-window-past-context": ("MistralConfig", {"sliding_window": 512}),
    # windows far shorter than the 264 positions: prefill, decode and paging all slide (a
    # window of 20 ends inside a page of 8)
    "mistral-window": ("MistralConfig", {"sliding_window": 20}),
    # Qwen: the layers from max_window_layers on slide; or those layer_types names
    "qwen2-window": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
    ),
    "qwen3-window-layer-types": (
        "Qwen3Config",
        {
            "head_dim": 32,
            "use_sliding_window": True,
            "sliding_window": 48,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # Gemma 2: its defaults (soft-caps 50 and 30, query_pre_attn_scalar 256, layer 0 sliding,
    # tied) with a window of 24, and scores large enough that the caps bite
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 24}),
    "gemma2-small-caps": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 8,
            "tie_word_embeddings": False,
        },
    ),
    "gemma2-no-caps": (
        "Gemma2Config",
        {"head_dim": 16, "attn_logit_softcapping": None, "final_logit_softcapping": None},
    ),
    # Qwen3-MoE: every layer's MLP routed, 8 experts of 32, top 2 renormalized
    "qwen3-moe": ("Qwen3MoeConfig", {**MOE, "norm_topk_prob": True}),
    # layers 0 and 2 dense by decoder_sparse_step 2, layer 3 by mlp_only_layers: 1 is sparse
    "qwen3-moe-mixed-layers": (
        "Qwen3MoeConfig",
        {**MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
    ),
    # the top 3 of 4 experts' own probabilities, not summing to one; attention biases
    "qwen3-moe-no-norm-topk": (
        "Qwen3MoeConfig",
        {**MOE, "num_experts": 4, "num_experts_per_tok": 3, "attention_bias": True},
    ),
    # Qwen3-MoE's window slides on every layer
    "qwen3-moe-window": (
        "Qwen3MoeConfig",
        {**MOE, "norm_topk_prob": True, "use_sliding_window": True, "sliding_window": 20},
    ),
    # Gemma 3 text: its defaults (no caps, query_pre_attn_scalar 256, tied, rope_theta 1e6 on
    # the global layers and 1e4 on the sliding ones) with a window of 24 and every 2nd layer
    # global, so that the 2 layers are one of each kind and each rotates by its own RoPE
    "gemma3": ("Gemma3TextConfig", GEMMA3),
    # a linear factor of 8 on the global layers only, as Gemma 3 4B+ have (given as their
    # rope_scaling, saved as transformers 5's rope_parameters by layer type)
    "gemma3-linear-rope": (
        "Gemma3TextConfig",
        {**GEMMA3, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    ),
    # the final logits' soft-cap, a small one that bites (transformers' Gemma 3 applies no
    # attention soft-cap, and kvfence refuses one: test_model_refusals.py), untied
    "gemma3-softcaps": (
        "Gemma3TextConfig",
        {
            **GEMMA3,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 8,
            "tie_word_embeddings": False,
        },
    ),
    # Phi-3/4: q/k/v and gate/up stored fused; Phi-3-mini-4k's window (2047) scaled down
    "phi3": ("Phi3Config", {}),
    "phi3-window": ("Phi3Config", {"sliding_window": 20}),
    "phi3-partial-rotary": ("Phi3Config", PHI3_PARTIAL),
    # served 512 > original 64: long factors, as transformers for a 200-token prompt
    "phi3-longrope": ("Phi3Config", {**longrope(6, 64), **PHI3_PARTIAL}),
    # served 320 = original 320 (SERVED): short factors, as transformers below it
    "phi3-longrope-short": ("Phi3Config", longrope(8, 320)),
}
# the served context (--context-length) of a case that sets one
SERVED = {"phi3-longrope-short": 320}
# One case of each family, a sliding window wherever the family has one: what the serving
# paths beyond the combined engine's (disaggregation, preemption) are checked on. Untied:
# a tied tiny model's greedy token is mostly its input token again, whatever the KV says
# (its pages sent in reverse order, the tied llama3 and gemma3 cases still passed).
FAMILIES = [
    "llama-llama3",
    "mistral-window",
    "qwen2-window",
    "qwen3-window-layer-types",
    "gemma2-small-caps",
    "gemma3-softcaps",
    "phi3-longrope",
    "qwen3-moe-window",
]
