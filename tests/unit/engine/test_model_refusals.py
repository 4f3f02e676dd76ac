"""What kvfence does not implement is refused at load, by name: each config.json field and value
that would change the computation, each unknown tensor, each GGUF key or tensor, and a served
context a model's window or RoPE cannot give exactly. And real checkpoints' config.json files
are read as transformers reads them. (What is served: test_model_families.py.)"""

import copy
import dataclasses
import importlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFWriter
from safetensors.torch import load_file, save_file

from helpers.transformers_reference import hf_model
from kvfence_cli.main import main
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.model_config import Family, ModelConfig, RopeScaling, RopeType
from kvfence_engine.core.rope import rope_frequencies
from kvfence_engine.loading.config import load_config
from kvfence_engine.loading.gguf_config import gguf_config
from kvfence_engine.loading.hf_config import read_hf_config
from kvfence_engine.loading.loader import load_model

ROOT = Path(__file__).resolve().parents[3]
HUB = {
    "llama-3.2-1b": ROOT / "bench/configs/llama-3.2-1b.json",
    **{p.stem: p for p in (ROOT / "tests/helpers/samples/hub_configs").glob("*.json")},
}


def hub(name: str) -> dict[str, Any]:
    return json.loads(HUB[name].read_text())


# --- real checkpoints' config.json -----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_configs_are_read_as_transformers_reads_them(name: str) -> None:
    raw = hub(name)
    ours = read_hf_config(raw)
    given = {k: v for k, v in copy.deepcopy(raw).items() if k != "model_type"}
    theirs = transformers.AutoConfig.for_model(raw["model_type"], **given)
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_hidden_layers,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        getattr(theirs, "head_dim", raw["hidden_size"] // raw["num_attention_heads"]),
    )
    assert (ours.max_positions, ours.tie_embeddings, ours.rms_eps) == (
        theirs.max_position_embeddings,
        theirs.tie_word_embeddings,
        theirs.rms_norm_eps,
    )
    model_type = raw["model_type"]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = transformers.models.auto.modeling_auto.MODEL_MAPPING_NAMES[model_type]
    assert isinstance(prefix, str)  # one model class for these families
    rotary = getattr(modeling, prefix.removesuffix("Model") + "RotaryEmbedding")(theirs)
    # transformers' table before any forward: longrope's short factors, ours where the served
    # context is within original_max_position_embeddings
    served = ours.rope.original_max_positions if ours.rope.type is RopeType.LONGROPE else None
    inv_freq, attention = rope_frequencies(
        ours.head_dim, ours.rope_theta, ours.rope, ours.max_positions, served
    )
    assert torch.equal(inv_freq, rotary.inv_freq) and attention == rotary.attention_scaling


def test_llama_3_2_reads_its_llama3_rope_scaling() -> None:
    config = read_hf_config(hub("llama-3.2-1b"))
    assert config.rope_theta == 500000.0 and config.tie_embeddings and config.head_dim == 64
    assert config.rope == RopeScaling(
        type=RopeType.LLAMA3,
        factor=32.0,
        original_max_positions=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )


def test_phi_4_mini_reads_its_longrope_and_partial_rotary_as_transformers() -> None:
    """Phi-4-mini: 96 of 128 head dims rotated, LongRoPE from 4096 to 131072 positions. The
    long factors are transformers' own (its longrope function past original_max), taken by an
    engine that serves more than 4096 positions; the short ones, within 4096."""
    raw = hub("phi-4-mini-instruct")
    ours = read_hf_config(raw)
    assert (ours.family, ours.tie_embeddings, ours.head_dim) == (Family.PHI3, True, 128)
    assert ours.rope.rotary_dim(ours.head_dim) == 96
    assert (ours.rope.type, ours.rope.original_max_positions, ours.rope.factor) == (
        RopeType.LONGROPE,
        4096,
        32.0,
    )
    # su: LongRoPE's older name, as Phi-3-mini-128k's first config.json spelled it
    assert read_hf_config(phi4_rope(type="su")) == ours
    given = {k: v for k, v in copy.deepcopy(raw).items() if k != "model_type"}
    theirs = transformers.AutoConfig.for_model("phi3", **given)
    longrope = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"]
    for served, seq_len in ((4096, None), (4097, 4097), (131072, 4097)):
        expected, expected_attention = longrope(theirs, None, seq_len=seq_len)
        inv_freq, attention = rope_frequencies(128, ours.rope_theta, ours.rope, 131072, served)
        assert torch.equal(inv_freq, expected), served
        assert (
            attention
            == expected_attention
            == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
        )


def test_phi_3_mini_slides_every_layer_by_its_window() -> None:
    config = read_hf_config(hub("phi-3-mini-4k-instruct"))
    assert config.family is Family.PHI3 and config.rope == RopeScaling()
    assert [config.layer_window(i) for i in (0, 31)] == [2047, 2047]


def test_the_windows_of_real_configs() -> None:
    """Qwen2.5 names a window it does not use (use_sliding_window false); Mistral 7B v0.1's
    4096 applies to every layer."""
    assert read_hf_config(hub("qwen2.5-0.5b-instruct")).sliding_window is None
    assert read_hf_config(hub("qwen3-0.6b")).sliding_window is None
    assert read_hf_config(hub("mistral-7b-v0.1")).sliding_window == 4096
    assert read_hf_config(hub("mistral-7b-v0.1")).full_attention_layers == ()
    assert read_hf_config(hub("mistral-7b-v0.1")).family is Family.LLAMA
    qwen = hub("qwen2.5-0.5b-instruct") | {"use_sliding_window": True, "max_window_layers": 21}
    windowed = read_hf_config(qwen)
    assert windowed.sliding_window == 32768
    assert windowed.full_attention_layers == tuple(range(21))
    assert [windowed.layer_window(i) for i in (20, 21, 23)] == [None, 32768, 32768]


# --- config.json refusals --------------------------------------------------------------------


def llama(**changes: Any) -> dict[str, Any]:
    return hub("llama-3.2-1b") | changes


def with_rope(**entry: Any) -> dict[str, Any]:
    return llama(rope_scaling=hub("llama-3.2-1b")["rope_scaling"] | entry)


def qwen3_moe(**changes: Any) -> dict[str, Any]:
    return hub("qwen3-30b-a3b") | changes


def phi4(**changes: Any) -> dict[str, Any]:
    return hub("phi-4-mini-instruct") | changes


def phi4_rope(**entry: Any) -> dict[str, Any]:
    return phi4(rope_scaling=hub("phi-4-mini-instruct")["rope_scaling"] | entry)


GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "vocab_size": 256000,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 107],
}
# Gemma 3 1B's config.json as transformers 4 wrote it (rope_theta, rope_local_base_freq,
# sliding_window_pattern; no layer_types); the 4B's text_config adds a linear rope_scaling
GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}
GEMMA3_4B_TEXT = GEMMA3 | {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}
# transformers 5's spelling: rope_parameters by layer type, layer_types beside the pattern
GEMMA3_SAVED = {k: v for k, v in GEMMA3_4B_TEXT.items() if not k.startswith("rope_")} | {
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(34)],
    "_sliding_window_pattern": 6,
}


def gemma3(**changes: Any) -> dict[str, Any]:
    return GEMMA3 | changes


REFUSED = {
    "longrope": (
        with_rope(rope_type="longrope"),
        "rope scaling type 'longrope' is not supported by kvfence",
    ),
    "unknown rope type": (
        with_rope(rope_type="su"),
        "rope scaling type 'su' is not supported by kvfence",
    ),
    "a key the variant does not read": (
        with_rope(beta_fast=32),
        "rope scaling key 'beta_fast'=32 is not one rope type 'llama3' reads",
    ),
    "a key the variant needs": (
        llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
        "rope scaling type 'llama3' needs 'low_freq_factor'",
    ),
    "partial rotary": (
        with_rope(partial_rotary_factor=0.5),
        "'partial_rotary_factor'=0.5 changes the computation and is not implemented",
    ),
    "rope_theta twice": (
        with_rope(rope_theta=10000.0),
        "rope_theta=500000.0 and rope_theta=10000.0 inside the rope scaling entry disagree",
    ),
    "both spellings, different": (
        llama(rope_parameters={"rope_type": "default"}),
        "'rope_scaling' and 'rope_parameters' are both given and differ",
    ),
    "type and rope_type": (
        with_rope(type="linear"),
        "rope scaling 'rope_type' and 'type' disagree",
    ),
    "hidden_act": (
        llama(hidden_act="gelu"),
        "field 'hidden_act'='gelu' changes the computation and is not implemented",
    ),
    "an unknown field": (
        llama(logit_softcapping=30.0),
        "field 'logit_softcapping'=30.0 is not one kvfence knows for LlamaForCausalLM",
    ),
    "quantized weights": (
        llama(quantization_config={"quant_method": "gptq"}),
        "field 'quantization_config'=",
    ),
    "interleaved rope": (
        llama(rope_interleaved=True),
        "field 'rope_interleaved'=true changes the computation and is not implemented",
    ),
    "another model type": (
        llama(model_type="phi", architectures=["PhiForCausalLM"]),
        "model_type 'phi' is not supported by kvfence",
    ),
    "another MoE": (
        llama(model_type="mixtral", architectures=["MixtralForCausalLM"]),
        "model_type 'mixtral' is not supported by kvfence",
    ),
    "a MoE's shared expert": (  # Qwen2-MoE's, which Qwen3-MoE has not
        qwen3_moe(shared_expert_intermediate_size=5632),
        "field 'shared_expert_intermediate_size'=5632 is not one kvfence knows for "
        "Qwen3MoeForCausalLM",
    ),
    "a MoE's layer types": (
        qwen3_moe(layer_types=["full_attention"] * 48),
        "field 'layer_types'=",
    ),
    "a MoE's window beside max_window_layers": (
        qwen3_moe(use_sliding_window=True, sliding_window=4096),
        "field 'max_window_layers'=48 with use_sliding_window true: transformers 5's "
        "Qwen3-MoE slides every layer",
    ),
    "two expert counts": (
        qwen3_moe(num_local_experts=64),
        "fields 'num_experts'=128 and 'num_local_experts'=64 disagree",
    ),
    "more experts per token than experts": (
        qwen3_moe(num_experts_per_tok=129),
        "field 'num_experts_per_tok'=129 is not between 1 and num_experts (128)",
    ),
    "no sparse step": (
        qwen3_moe(decoder_sparse_step=0),
        "field 'decoder_sparse_step'=0 is not a positive step",
    ),
    "another head": (
        llama(architectures=["LlamaForSequenceClassification"]),
        "architectures ['LlamaForSequenceClassification'] is not llama's LlamaForCausalLM",
    ),
    "nothing names the model": (
        {k: v for k, v in llama().items() if k not in ("model_type", "architectures")},
        "neither 'model_type' nor 'architectures' names the model",
    ),
    "a missing shape": (
        {k: v for k, v in llama().items() if k != "vocab_size"},
        "field 'vocab_size' is missing",
    ),
    "a field another family has": (
        hub("qwen2.5-0.5b-instruct") | {"attention_bias": False},
        "field 'attention_bias'=false is not one kvfence knows for Qwen2ForCausalLM",
    ),
    "a value of the wrong kind": (
        llama(max_position_embeddings=None),
        "a field holds a value kvfence cannot read",
    ),
    "layer types": (
        hub("qwen3-0.6b") | {"layer_types": ["full_attention"] * 27 + ["chunked_attention"]},
        "field 'layer_types'=",
    ),
    "sliding layers without a window": (
        hub("qwen3-0.6b") | {"layer_types": ["sliding_attention"] * 28},
        "names sliding_attention layers without a window",
    ),
    "bidirectional gemma": (
        {**GEMMA2, "use_bidirectional_attention": True},
        "field 'use_bidirectional_attention'=true changes the computation and is not implemented",
    ),
    "gemma's activation": (
        {**GEMMA2, "hidden_activation": "gelu"},
        "field 'hidden_activation'='gelu' changes the computation and is not implemented",
    ),
    "gemma 3 multimodal": (
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
         "text_config": {k: v for k, v in GEMMA3_4B_TEXT.items() if k != "architectures"},
         "vision_config": {"model_type": "siglip_vision_model"}},
        "model_type 'gemma3' is Gemma3ForConditionalGeneration, Gemma 3's image-and-text "
        "model, which kvfence does not serve (it serves the text-only Gemma3ForCausalLM, "
        "model_type 'gemma3_text')",
    ),
    "bidirectional gemma 3": (
        gemma3(use_bidirectional_attention=True),
        "field 'use_bidirectional_attention'=true changes the computation and is not implemented",
    ),
    # transformers' Gemma3 never applies it, other implementations do
    "gemma 3 attention soft-cap": (
        gemma3(attn_logit_softcapping=50.0),
        "field 'attn_logit_softcapping'=50.0 is one transformers' Gemma3ForCausalLM ignores "
        "and other implementations apply",
    ),
    "gemma 3 flat rope_parameters": (  # transformers keeps the layer types' entries, not it
        gemma3(rope_scaling=None, rope_parameters={"rope_type": "linear", "factor": 8.0}),
        "field 'rope_parameters'={\"rope_type\": \"linear\", \"factor\": 8.0} is not keyed by "
        "layer type (full_attention and sliding_attention)",
    ),
    "gemma 3 both rope spellings": (
        GEMMA3_SAVED | {"rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
        "'rope_scaling' and 'rope_parameters' are both given",
    ),
    "gemma 3 sliding rope type": (
        GEMMA3_SAVED | {"rope_parameters": {"sliding_attention": {"rope_type": "longrope"}}},
        "sliding_attention layers: rope scaling type 'longrope' is not supported by kvfence",
    ),
    "gemma 3 local theta twice": (
        GEMMA3_SAVED | {"rope_local_base_freq": 20000.0},
        "sliding_attention layers: field 'rope_local_base_freq'=20000.0 and rope_theta=10000.0 "
        "in rope_parameters disagree",
    ),
    "gemma 3 pattern": (
        gemma3(sliding_window_pattern=0),
        "field 'sliding_window_pattern'=0 is not a whole number >= 1",
    ),
    # Phi3Config reads yarn as longrope; kvfence serves only what it names
    "phi3 yarn": (
        phi4(rope_scaling={"type": "yarn", "factor": 4.0}),
        "rope scaling type 'yarn' is not supported by kvfence (supported: default, longrope)",
    ),
    "phi3 mscales": (
        phi4_rope(short_mscale=1.2, long_mscale=1.2),
        "rope scaling key 'long_mscale'=1.2 is not one rope type 'longrope' reads",
    ),
    "phi3 original context twice": (
        phi4_rope(original_max_position_embeddings=8192),
        "rope scaling key 'original_max_position_embeddings'=8192 and the field "
        "'original_max_position_embeddings'=4096 disagree",
    ),
    # transformers' Phi3Config takes 4096 then, whatever the entry says
    "phi3 original context only in the entry": (
        {
            **{k: v for k, v in phi4().items() if k != "original_max_position_embeddings"},
            "rope_scaling": phi4()["rope_scaling"] | {"original_max_position_embeddings": 8192},
        },
        "'original_max_position_embeddings'=4096 (its default where config.json leaves it out) "
        "disagree",
    ),
    "phi3 partial rotary twice": (
        phi4_rope(partial_rotary_factor=0.5),
        "rope scaling key 'partial_rotary_factor'=0.5 and the field 'partial_rotary_factor'=0.75 "
        "disagree",
    ),
    "phi3 an odd rotary dim": (
        phi4(partial_rotary_factor=0.7, rope_scaling=None),
        "'partial_rotary_factor'=0.7 rotates 89 of the 128 head dims",
    ),
    "phi3 factors for another head": (
        phi4_rope(short_factor=[1.0] * 64),
        "rope scaling key 'short_factor' has 64 values; the 96 rotated dims of a head take 48",
    ),
    "phi3 factors that are not numbers": (
        phi4_rope(long_factor="4.0"),
        "rope scaling key 'long_factor'=\"4.0\" is not a list of numbers",
    ),
    "phi3 longrope without its factors": (
        phi4(rope_scaling={"type": "longrope", "short_factor": [1.0] * 48}),
        "rope scaling type 'longrope' needs 'long_factor'",
    ),
    "phi3 remote code's full attention period": (
        phi4(full_attn_mod=2),
        "field 'full_attn_mod'=2 changes the computation and is not implemented",
    ),
    "phi3 biases": (
        phi4(attention_bias=True),
        "field 'attention_bias'=true changes the computation and is not implemented",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_a_config_field_kvfence_does_not_implement_is_refused_by_name(case: str) -> None:
    raw, message = REFUSED[case]
    with pytest.raises(ValueError) as refused:
        read_hf_config(raw)
    assert str(refused.value).startswith("config.json: ")
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)  # one line


def test_gemma_2_reads_its_scales_caps_and_alternating_windows() -> None:
    """Gemma 2's fields as its hub configs carry them (hidden_act beside hidden_activation,
    which Gemma2Config does not read; cache_implementation; an eos list), a 2B's shape."""
    config = read_hf_config(GEMMA2)
    assert config.family is Family.GEMMA2 and config.tie_embeddings
    assert (config.embed_scale, config.query_scale) == (48.0, 1 / 16)
    assert (config.attn_softcap, config.logit_softcap) == (50.0, 30.0)
    assert config.activation == "gelu_pytorch_tanh"
    assert [config.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert config.full_attention_layers == tuple(range(1, 26, 2))


def test_qwen3_30b_a3b_reads_its_experts() -> None:
    """128 experts of 768, the top 8 renormalized, on every layer; no window (max_window_layers
    beside use_sliding_window false changes nothing). transformers 5 saves the count as
    num_local_experts; the router's loss settings are training only."""
    config = read_hf_config(hub("qwen3-30b-a3b"))
    assert config.family is Family.QWEN3_MOE and config.head_dim == 128
    assert (config.num_experts, config.experts_per_token, config.moe_intermediate_size) == (
        128,
        8,
        768,
    )
    assert config.norm_topk_prob and config.sliding_window is None
    assert all(config.layer_is_sparse(i) for i in range(48))
    saved = {k: v for k, v in hub("qwen3-30b-a3b").items() if k != "num_experts"}
    training = {"router_aux_loss_coef": 0.5, "output_router_logits": True}
    assert read_hf_config(saved | {"num_local_experts": 128} | training) == config
    mixed = read_hf_config(qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[5]))
    assert [mixed.layer_is_sparse(i) for i in range(6)] == [False, True, False, True] + [False] * 2
    windowed = qwen3_moe(use_sliding_window=True, sliding_window=4096)
    del windowed["max_window_layers"]
    assert read_hf_config(windowed).sliding_window == 4096
    assert read_hf_config(windowed).full_attention_layers == ()


# each config and the linear factor of its global layers
GEMMA3_HUB: dict[str, tuple[dict[str, Any], float]] = {
    "1b": (GEMMA3, 1.0),
    "4b-text": (GEMMA3_4B_TEXT, 8.0),
    "4b-text, other thetas": (
        GEMMA3_4B_TEXT | {"rope_theta": 5e5, "rope_local_base_freq": 2e4},
        8.0,
    ),
    "saved": (GEMMA3_SAVED, 8.0),
}


@pytest.mark.parametrize("name", GEMMA3_HUB)
def test_gemma_3_configs_are_read_as_transformers_reads_them(name: str) -> None:
    """Each kind of layer, its window and its RoPE, from either spelling, as Gemma3TextConfig
    and Gemma3RotaryEmbedding make them; the scales as Gemma3ForCausalLM applies them."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    raw, factor = GEMMA3_HUB[name]
    ours = read_hf_config(raw)
    theirs = transformers.Gemma3TextConfig(**copy.deepcopy(raw))
    assert ours.family is Family.GEMMA3 and ours.tie_embeddings
    windows = [ours.layer_window(i) for i in range(ours.num_layers)]
    assert theirs.layer_types is not None
    assert windows == [
        theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types
    ]
    assert windows[:6] == [raw["sliding_window"]] * 5 + [None]
    assert (ours.embed_scale, ours.query_scale) == (theirs.hidden_size**0.5, 1 / 16)
    assert (ours.attn_softcap, ours.logit_softcap) == (None, None)
    rotary = Gemma3RotaryEmbedding(theirs)
    for layer_type, theta, rope in (
        ("full_attention", ours.rope_theta, ours.rope),
        ("sliding_attention", ours.sliding_rope_theta, ours.sliding_rope),
    ):
        assert theta is not None
        inv_freq, attention = rope_frequencies(ours.head_dim, theta, rope, ours.max_positions)
        assert torch.equal(inv_freq, getattr(rotary, f"{layer_type}_inv_freq"))
        assert attention == getattr(rotary, f"{layer_type}_attention_scaling")
    assert ours.rope.factor == factor and ours.sliding_rope == RopeScaling()


def test_gemma_3s_layer_types_win_over_its_pattern_as_in_transformers() -> None:
    """transformers 5 saves both; a pattern beside layer_types is not read."""
    types = ["sliding_attention", "full_attention"] * 13
    config = read_hf_config(gemma3(layer_types=types, sliding_window_pattern=3))
    assert config.full_attention_layers == tuple(range(1, 26, 2))
    assert transformers.Gemma3TextConfig(**gemma3(layer_types=types)).layer_types == types


def test_fields_that_change_nothing_load() -> None:
    config = read_hf_config(llama(attention_dropout=0.1, pad_token_id=None, dtype="float32"))
    assert config == read_hf_config(llama())


# --- at load and at start, through the real loader and engine --------------------------------


@pytest.mark.slow  # builds and saves a transformers model
def test_a_refusal_reaches_kvfence_preflight_as_one_line(tmp_path: Path, capsys) -> None:
    hf_model(tmp_path, "LlamaConfig")
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] |= {"rope_type": "longrope"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope scaling type 'longrope' is not supported"):
        load_model(str(tmp_path))
    capsys.readouterr()  # what saving the checkpoint printed
    code = main(["preflight", "--model", str(tmp_path), "--kv-cache-memory", "1Mi",
                 "--context-length", "64"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        f"kvfence preflight: {tmp_path / 'config.json'}: rope scaling type 'longrope' is not "
        "supported by kvfence (supported: default, linear, dynamic, llama3, yarn)\n"
    )


def test_a_window_shorter_than_the_context_is_served_and_preflight_sizes_the_whole_context(
    tmp_path: Path, capsys
) -> None:
    """Mistral with sliding_window 32 at a context of 512 (its attention: the families'
    conformance cases). The pool keeps every page of a sequence, so preflight sizes it for
    the whole context, as without a window."""
    hf_model(tmp_path, "MistralConfig", sliding_window=32)
    loaded = load_model(str(tmp_path))
    assert loaded.config.sliding_window == 32
    engine = LLMEngine(loaded, EngineArgs(kv_cache_memory=1 << 20, page_size=8))
    assert engine.context_effective == 512
    code = main(["preflight", "--model", str(tmp_path), "--kv-cache-memory", "1Mi",
                 "--context-length", "512"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "KV bytes per token: 512 (float32" in out  # 2 layers x 2 heads x 16 dims x K, V
    assert "context 512: fits" in out


@pytest.mark.parametrize(
    ("name", "bytes_per_token"),
    [("1b", 26624), ("4b-text", 139264)],  # 2 x 26 layers x 1 head / 34 x 4 heads x 256 x 2
)
def test_preflight_sizes_a_gemma_3_pool_for_every_layer_at_the_whole_context(
    name: str, bytes_per_token: int, tmp_path: Path, capsys
) -> None:
    """From config.json alone: the sliding layers' keys stay in the pool as the global
    layers' do (a window only masks), so each token costs K and V in every layer."""
    raw, _ = GEMMA3_HUB[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    positions = raw["max_position_embeddings"]
    flags = ["--model", str(tmp_path), "--kv-cache-dtype", "bfloat16", "--kv-cache-memory"]
    budget = str(bytes_per_token * (positions + 64))
    assert main(["preflight", *flags, budget, "--context-length", str(positions)]) == 0
    out = capsys.readouterr().out
    assert f"KV bytes per token: {bytes_per_token} (bfloat16" in out
    assert f"context {positions}: fits" in out
    assert main(["preflight", *flags, budget, "--context-length", str(positions + 1)]) == 1
    assert f"DOES NOT FIT the model's {positions} positions" in capsys.readouterr().out


def test_dynamic_rope_is_refused_past_max_position_embeddings_saying_why(tmp_path: Path) -> None:
    hf_model(tmp_path, "LlamaConfig", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError) as refused:
        LLMEngine(
            load_model(str(tmp_path)), EngineArgs(kv_cache_memory=1 << 20, context_length=1024)
        )
    assert str(refused.value).startswith(
        "--context-length 1024 exceeds the model's 512 positions (rope scaling type 'dynamic': "
    )


def test_untied_weights_need_their_lm_head(tmp_path: Path) -> None:
    hf_model(tmp_path, "LlamaConfig")
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as refused:
        LLMEngine(load_model(str(tmp_path)), EngineArgs(kv_cache_memory=1 << 20))
    assert str(refused.value) == (
        "weights: the llama model needs tensor 'lm_head.weight', not found"
    )


def test_a_tensor_no_layer_takes_is_refused(tmp_path: Path) -> None:
    """A Qwen3 checkpoint's q/k norms under a config that says Qwen2 would be ignored, and
    the model silently another one."""
    hf_model(tmp_path, "Qwen3Config", head_dim=16)
    config = json.loads((tmp_path / "config.json").read_text())
    drop = ("head_dim", "attention_bias")
    qwen2 = {k: v for k, v in config.items() if k not in drop} | {"model_type": "qwen2"}
    qwen2["architectures"] = ["Qwen2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(qwen2))
    weights = load_file(str(tmp_path / "model.safetensors"))
    for i in range(2):  # qwen2 has q/k/v biases: give it some, so that only the norms are left
        for p, rows in (("q", 64), ("k", 32), ("v", 32)):
            weights[f"model.layers.{i}.self_attn.{p}_proj.bias"] = torch.zeros(rows)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as refused:
        LLMEngine(load_model(str(tmp_path)), EngineArgs(kv_cache_memory=1 << 20))
    assert str(refused.value).startswith(
        "weights: 4 tensors the qwen2 model does not use ('model.layers.0.self_attn.k_norm.weight'"
    )


def test_a_moe_checkpoint_is_read_expert_by_expert_and_nothing_else(tmp_path: Path) -> None:
    """Qwen3-MoE's experts as Hub checkpoints (and transformers 5's save_pretrained) hold
    them, mlp.experts.{e}.*_proj.weight: a missing expert is named; the fused 3-D tensors
    of transformers' in-memory model (mlp.experts.gate_up_proj), beside them, are a tensor
    no layer takes."""
    moe = {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    hf_model(tmp_path, "Qwen3MoeConfig", **moe)
    saved = load_file(str(tmp_path / "model.safetensors"))

    def refusal(weights: dict[str, torch.Tensor]) -> str:
        save_file(weights, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError) as refused:
            LLMEngine(load_model(str(tmp_path)), EngineArgs(kv_cache_memory=1 << 20))
        return str(refused.value)

    missing = {k: v for k, v in saved.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    assert refusal(missing) == (
        "weights: the qwen3_moe model needs tensor "
        "'model.layers.1.mlp.experts.3.up_proj.weight', not found"
    )
    fused = saved | {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 64)}
    assert refusal(fused) == (
        "weights: 1 tensors the qwen3_moe model does not use "
        "('model.layers.0.mlp.experts.gate_up_proj'): a part of the model kvfence does not "
        "implement"
    )


# --- GGUF metadata ---------------------------------------------------------------------------


def write_gguf(
    path: Path, metadata: dict[str, Any], tensors: tuple[str, ...] = (), arch: str = "llama"
) -> Path:
    """A GGUF with a Llama's metadata (+ `metadata`; None leaves a key out), tiny tensors."""
    values: dict[str, Any] = {
        "llama.block_count": 1,
        "llama.context_length": 256,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.dimension_count": 16,
        "llama.rope.freq_base": 10000.0,
    } | metadata
    writer = GGUFWriter(str(path), arch)
    for key, value in values.items():
        if value is None:  # left out
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_token_list([f"t{i}" for i in range(32)])
    for name in ("token_embd.weight", "blk.0.attn_q.weight", *tensors):
        writer.add_tensor(name, np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    return gguf_config(GGUFReader(str(path)), path)[0]


def test_gguf_linear_rope_scaling_is_transformers_linear(tmp_path: Path) -> None:
    """llama.cpp's linear scaling (positions times freq_scale = 1 / factor) is transformers'
    (frequencies / factor): one RopeScaling, the same tables (test_model_families.py)."""
    path = write_gguf(
        tmp_path / "m.gguf", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    )
    assert read_gguf(path).rope == RopeScaling(type=RopeType.LINEAR, factor=4.0)
    assert read_gguf(write_gguf(tmp_path / "n.gguf", {})).rope == RopeScaling()
    assert load_config(str(path)).rope.factor == 4.0


GGUF_REFUSED: dict[str, tuple[dict[str, Any], tuple[str, ...], str]] = {
    "yarn": (
        {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
         "llama.rope.scaling.attn_factor": 1.0},
        (),
        "GGUF rope scaling type 'yarn' ('llama.rope.scaling.type') is not supported by kvfence",
    ),
    "an unknown key": (
        {"llama.expert_count": 8},
        (),
        "GGUF key 'llama.expert_count'=8 is not one kvfence implements",
    ),
    "partial rotary": (
        {"llama.rope.dimension_count": 8},
        (),
        "GGUF key 'llama.rope.dimension_count'=8 is not the head dim 16 and is not implemented",
    ),
    "a missing key": (
        {"llama.feed_forward_length": None},
        (),
        "GGUF key 'llama.feed_forward_length' is missing",
    ),
    # (write_gguf's tensors are 4 x 32: 128 factors for a head dim of 16)
    "frequency factors of another head dim": (
        {},
        ("rope_freqs.weight",),
        "GGUF tensor 'rope_freqs.weight' holds 128 factors; kvfence needs 8 (one per rotated",
    ),
    "frequency factors beside a scaling type": (
        {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
        ("rope_freqs.weight",),
        "GGUF tensor 'rope_freqs.weight' beside rope scaling type 'linear' is not supported",
    ),
    "an unknown tensor": (
        {},
        ("blk.0.ffn_gate_exps.weight",),
        "GGUF tensor 'blk.0.ffn_gate_exps.weight' is not one kvfence implements",
    ),
    "another architecture": (
        {"general.architecture": "gemma2"},  # its keys are llama.*: refused before them
        (),
        "GGUF architecture 'gemma2' is not supported by kvfence",
    ),
    # kvfence serves Qwen3-MoE from Hugging Face folders only (so never with int4 weights,
    # which keep a GGUF's own blocks)
    "a MoE architecture": (
        {"general.architecture": "qwen3moe"},
        (),
        "GGUF architecture 'qwen3moe' is not supported by kvfence",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", GGUF_REFUSED)
def test_gguf_metadata_kvfence_does_not_implement_is_refused_by_name(
    case: str, tmp_path: Path
) -> None:
    metadata, tensors, message = GGUF_REFUSED[case]
    metadata = dict(metadata)  # the case stays as written for the next run
    arch = metadata.pop("general.architecture", "llama")
    path = write_gguf(tmp_path / "m.gguf", metadata, tensors, arch)
    with pytest.raises(ValueError) as refused:
        read_gguf(path)
    assert str(refused.value).startswith(f"{path}: {message}")


def test_a_config_survives_the_conversion_cache_as_itself() -> None:
    """A converted GGUF's cache stores its ModelConfig as JSON: the family and the RoPE type
    must come back as what they were, not as strings a variant check would not recognise."""
    config = read_hf_config(hub("qwen3-0.6b") | {"rope_scaling": {"type": "linear", "factor": 2}})
    back = ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(config))))
    assert back == config
    assert back.rope.type is RopeType.LINEAR and back.family is Family.QWEN3
    moe = read_hf_config(qwen3_moe(mlp_only_layers=[0, 3]))
    assert ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(moe)))) == moe
    gemma = read_hf_config(GEMMA3_4B_TEXT)
    back = ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(gemma))))
    assert back == gemma and back.sliding_rope.type is RopeType.DEFAULT
