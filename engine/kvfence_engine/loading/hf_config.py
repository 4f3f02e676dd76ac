"""A Hugging Face folder's config.json, strictly: every field is one kvfence implements, one
that changes nothing it computes, or a refusal that names it. The families and their fields
are transformers 5's config classes (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
Gemma2Config, Qwen3MoeConfig, Gemma3TextConfig, Phi3Config);
a field left out takes that class's default, as transformers would."""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfence_engine.core.model_config import Family, ModelConfig, RopeType
from kvfence_engine.loading.hf_rope import (
    STANDARD,
    RopeRules,
    check_rotary_dims,
    hf_rope,
    hf_rope_by_layer_type,
)

# Read by every family: the shape (these five must be given), the activation and the RoPE.
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
COMMON = {
    *REQUIRED,
    "model_type",
    "architectures",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
}
# Fields that change nothing kvfence computes: provenance, the dtype the file was saved in
# (the engine chooses its own), token ids (the tokenizer reads eos), training-only settings
# (dropout, initialization), generation-time caching.
IRRELEVANT = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "tokenizer_class",
    "transformers.js_config",  # SmolLM2's: for transformers.js
}


@dataclass(frozen=True, slots=True)
class FamilySpec:
    family: Family
    architecture: str  # the CausalLM class of architectures[0]
    fields: frozenset[str]  # implemented, besides COMMON
    defaults: dict[str, Any]  # the config class's, for the fields config.json may leave out
    irrelevant: frozenset[str] = frozenset()
    # accepted at these values only: the ones kvfence computes
    fixed: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    activation_field: str = "hidden_act"  # Gemma's is hidden_activation
    rope: RopeRules = STANDARD


# Qwen3MoeConfig's experts; num_local_experts is how transformers 5 saves num_experts
MOE_FIELDS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)
_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
_GEMMA_FIELDS = {
    "attention_bias",
    "hidden_activation",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "attn_logit_softcapping",
}
SPECS = {
    "llama": FamilySpec(
        Family.LLAMA,
        "LlamaForCausalLM",
        frozenset({"attention_bias", "mlp_bias"}),
        {"num_key_value_heads": None, "max_position_embeddings": 2048},
        # pretraining_tp: transformers 5 computes the same function whatever it says;
        # is_llama_config: a nanotron export's marker (SmolLM2)
        irrelevant=frozenset({"pretraining_tp", "is_llama_config"}),
        fixed={"rope_interleaved": (False,)},  # nanotron's; kvfence rotates halves
    ),
    "mistral": FamilySpec(
        Family.LLAMA,
        "MistralForCausalLM",
        frozenset({"sliding_window"}),
        {"num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
    ),
    "qwen2": FamilySpec(
        Family.QWEN2,
        "Qwen2ForCausalLM",
        frozenset({*_QWEN_WINDOW, "layer_types"}),
        {"num_key_value_heads": 32, "max_position_embeddings": 32768, **_QWEN_WINDOW},
    ),
    "qwen3": FamilySpec(
        Family.QWEN3,
        "Qwen3ForCausalLM",
        frozenset({*_QWEN_WINDOW, "layer_types", "attention_bias"}),
        {
            "num_key_value_heads": 32,
            "head_dim": 128,
            "max_position_embeddings": 32768,
            **_QWEN_WINDOW,
        },
    ),
    "gemma2": FamilySpec(
        Family.GEMMA2,
        "Gemma2ForCausalLM",
        frozenset(_GEMMA_FIELDS),
        {
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
        # hidden_act: Gemma2Config does not read it (its hub configs repeat hidden_activation
        # there); cache_implementation: transformers' generation-time cache
        irrelevant=frozenset({"hidden_act", "cache_implementation"}),
        fixed={"use_bidirectional_attention": (None, False)},
        activation_field="hidden_activation",
    ),
    "qwen3_moe": FamilySpec(
        Family.QWEN3_MOE,
        "Qwen3MoeForCausalLM",
        frozenset({*_QWEN_WINDOW, "attention_bias", *MOE_FIELDS}),
        {
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "use_sliding_window": False,
            "sliding_window": 4096,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": None,
        },
        # the router's auxiliary loss: training only
        irrelevant=frozenset({"router_aux_loss_coef", "output_router_logits"}),
    ),
    "gemma3_text": FamilySpec(
        Family.GEMMA3,
        "Gemma3ForCausalLM",
        # sliding_window_pattern: transformers 4's layer_types (every pattern-th layer global)
        frozenset({*_GEMMA_FIELDS, "sliding_window_pattern", "rope_local_base_freq"}),
        {
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "sliding_window_pattern": 6,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        },
        # _sliding_window_pattern: transformers 5 saves its copy of the pattern, read from nowhere
        irrelevant=frozenset({"hidden_act", "cache_implementation", "_sliding_window_pattern"}),
        fixed={"use_bidirectional_attention": (None, False)},
        activation_field="hidden_activation",
    ),
    "phi3": FamilySpec(
        Family.PHI3,
        "Phi3ForCausalLM",
        frozenset({"sliding_window", "original_max_position_embeddings", "partial_rotary_factor"}),
        {"num_key_value_heads": None, "max_position_embeddings": 4096, "sliding_window": None},
        # resid_pdrop, embd_pdrop: training-only dropout; auto_map: the checkpoint's own copy
        # of the modeling code (trust_remote_code), which transformers' Phi3 replaces
        irrelevant=frozenset({"resid_pdrop", "embd_pdrop", "auto_map"}),
        # Phi-4-mini's, for its remote code; transformers' Phi3 has no biases and reads
        # neither of the others: accepted at the values that code computes the same with
        fixed={
            "attention_bias": (False,),
            "mlp_bias": (False,),
            "lm_head_bias": (False,),
            "full_attn_mod": (1,),
            "interpolate_factor": (1,),
        },
        # Phi3Config: default or longrope (su, its old name); original_max_position_embeddings
        # at the top level (default 4096) is the one longrope reads
        rope=RopeRules(
            frozenset({RopeType.DEFAULT, RopeType.LONGROPE}),
            aliases={"su": RopeType.LONGROPE},
            top_level={"partial_rotary_factor": None, "original_max_position_embeddings": 4096},
            partial_rotary=True,
        ),
    ),
}
# model types kvfence knows and does not serve, and why
UNSERVED = {
    "gemma3": "Gemma3ForConditionalGeneration, Gemma 3's image-and-text model, which kvfence "
    "does not serve (it serves the text-only Gemma3ForCausalLM, model_type 'gemma3_text')",
}
ARCHITECTURES = {spec.architecture: model_type for model_type, spec in SPECS.items()}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # core/layers.py computes these


def hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    return read_hf_config(json.loads(path.read_text()), str(path))


def read_hf_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    try:
        return _read(raw, where)
    except (TypeError, KeyError) as exc:  # a value of the wrong kind, e.g. a null count
        raise ValueError(f"{where}: a field holds a value kvfence cannot read ({exc})") from None


def _read(raw: dict[str, Any], where: str) -> ModelConfig:
    model_type = _model_type(raw, where)
    spec = SPECS[model_type]
    _refuse_unknown(raw, spec, where)
    get = _getter(raw, spec)
    for name in REQUIRED:
        if raw.get(name) is None:
            raise ValueError(f"{where}: field {name!r} is missing")
    act = get(spec.activation_field, "silu")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"{where}: field {spec.activation_field!r}={act!r} changes the computation and is "
            f"not implemented (kvfence computes {' and '.join(ACTIVATIONS)})"
        )
    heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    max_positions = int(get("max_position_embeddings"))
    head_dim = int(get("head_dim") or hidden // heads)
    ropes = _ropes(raw, spec, max_positions, where)
    check_rotary_dims(ropes["rope"], head_dim, where)
    window, full_layers = _window(raw, model_type, get, where)
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_eps=float(get("rms_norm_eps", 1e-6)),
        max_positions=max_positions,
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=bool(get("attention_bias", False)),
        mlp_bias=bool(get("mlp_bias", False)),
        family=spec.family,
        sliding_window=window,
        full_attention_layers=full_layers,
        activation=act,
        **_experts(raw, get, where) if spec.family is Family.QWEN3_MOE else {},
        **ropes,
        **_gemma(get, spec.family, where) if spec.family in GEMMAS else {},
    )


def _ropes(raw: dict[str, Any], spec: FamilySpec, max_positions: int, where: str) -> dict[str, Any]:
    """rope_theta and its scaling, by the family's rules; Gemma 3's sliding layers have theirs."""
    if spec.family is not Family.GEMMA3:
        theta, rope = hf_rope(raw, max_positions, where, spec.rope)
        return {"rope_theta": theta, "rope": rope}
    ropes = hf_rope_by_layer_type(raw, max_positions, where)
    (theta, rope), (sliding_theta, sliding) = ropes["full_attention"], ropes["sliding_attention"]
    return {"rope_theta": theta, "rope": rope, "sliding_rope_theta": sliding_theta,
            "sliding_rope": sliding}  # fmt: skip


GEMMAS = (Family.GEMMA2, Family.GEMMA3)


def _gemma(get: Callable[..., Any], family: Family, where: str) -> dict[str, Any]:
    """Gemma 2's and 3's scales: embeddings times sqrt(hidden_size), attention scores times
    query_pre_attn_scalar ** -0.5, soft-caps (null: none)."""
    attn_cap, logit_cap = get("attn_logit_softcapping"), get("final_logit_softcapping")
    if attn_cap is not None and family is Family.GEMMA3:
        # Gemma 3 replaced the attention soft-cap with q/k norms: transformers' Gemma3 reads
        # the field and never applies it, other implementations apply it; kvfence guesses neither
        raise ValueError(
            f"{where}: field 'attn_logit_softcapping'={json.dumps(attn_cap)} is one "
            "transformers' Gemma3ForCausalLM ignores and other implementations apply: kvfence "
            "serves Gemma 3 with it null only"
        )
    return {
        "embed_scale": float(get("hidden_size")) ** 0.5,
        "query_scale": float(get("query_pre_attn_scalar")) ** -0.5,
        "attn_softcap": None if attn_cap is None else float(attn_cap),
        "logit_softcap": None if logit_cap is None else float(logit_cap),
    }


def _experts(raw: dict[str, Any], get: Callable[..., Any], where: str) -> dict[str, Any]:
    """Qwen3-MoE's experts, as Qwen3MoeDecoderLayer reads them: a layer is sparse where
    num_experts > 0, (layer + 1) % decoder_sparse_step == 0 and it is not in mlp_only_layers."""
    experts = int(get("num_experts"))
    if "num_local_experts" in raw:  # transformers 5's name for it; it wins where both are
        local = int(raw["num_local_experts"])
        if "num_experts" in raw and experts != local:
            raise ValueError(
                f"{where}: fields 'num_experts'={experts} and 'num_local_experts'={local} "
                "disagree (they are one count)"
            )
        experts = local
    top_k, step = int(get("num_experts_per_tok")), int(get("decoder_sparse_step"))
    if experts > 0 and not 1 <= top_k <= experts:
        raise ValueError(
            f"{where}: field 'num_experts_per_tok'={top_k} is not between 1 and num_experts "
            f"({experts})"
        )
    if step < 1:
        raise ValueError(f"{where}: field 'decoder_sparse_step'={step} is not a positive step")
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "moe_intermediate_size": int(get("moe_intermediate_size")),
        "norm_topk_prob": bool(get("norm_topk_prob")),
        "decoder_sparse_step": step,
        "mlp_only_layers": tuple(int(i) for i in get("mlp_only_layers") or ()),
    }


def _model_type(raw: dict[str, Any], where: str) -> str:
    """model_type decides, as in transformers' AutoConfig; architectures, if given, must be
    that family's CausalLM (a config with neither is refused: nothing says what it is)."""
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type is None and architectures:
        model_type = ARCHITECTURES.get(architectures[0])
        if model_type is None:
            raise ValueError(
                f"{where}: architecture {architectures[0]!r} is not supported "
                f"by kvfence (supported: {', '.join(ARCHITECTURES)})"
            )
    if model_type is None:
        raise ValueError(f"{where}: neither 'model_type' nor 'architectures' names the model")
    if model_type in UNSERVED:
        raise ValueError(f"{where}: model_type {model_type!r} is {UNSERVED[model_type]}")
    if model_type not in SPECS:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported by kvfence "
            f"(supported: {', '.join(SPECS)})"
        )
    expected = SPECS[model_type].architecture
    if architectures and architectures != [expected]:
        raise ValueError(
            f"{where}: architectures {architectures} is not {model_type}'s {expected}, the "
            "only one kvfence serves for it"
        )
    return model_type


def _refuse_unknown(raw: dict[str, Any], spec: FamilySpec, where: str) -> None:
    known = COMMON | spec.fields | IRRELEVANT | spec.irrelevant
    for name, value in raw.items():
        if name in spec.fixed:
            if value not in spec.fixed[name]:
                raise ValueError(
                    f"{where}: field {name!r}={json.dumps(value)} changes the "
                    "computation and is not implemented"
                )
        elif name not in known:
            raise ValueError(
                f"{where}: field {name!r}={json.dumps(value)} is not one kvfence "
                f"knows for {spec.architecture}; it may change the computation"
            )


def _getter(raw: dict[str, Any], spec: FamilySpec) -> Callable[..., Any]:
    """raw[name], or the family's default where config.json leaves it out (null is a value)."""

    def get(name: str, fallback: Any = None) -> Any:
        if name in raw:
            return raw[name]
        return spec.defaults.get(name, fallback)

    return get


def _window(
    raw: dict[str, Any], model_type: str, get: Callable[..., Any], where: str
) -> tuple[int | None, tuple[int, ...]]:
    """The attention window of the model's sliding layers (None where every layer attends to
    all positions), and the layers that do not slide. Mistral, and Qwen3-MoE if
    use_sliding_window: sliding_window for every layer. Qwen2 and Qwen3: sliding_window if
    use_sliding_window, on the layers layer_types names sliding (by default those from
    max_window_layers on), as transformers' Qwen configs. Phi-3: as Mistral."""
    if model_type == "llama":
        return None, ()
    window = get("sliding_window")
    if model_type in ("mistral", "phi3"):
        return (None if window is None else int(window)), ()
    layers = int(raw["num_hidden_layers"])
    types = get("layer_types")
    if model_type == "gemma2" and types is None:  # from the first, every other layer slides
        types = ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]
    if model_type == "gemma3_text" and types is None:  # every pattern-th layer global
        pattern = get("sliding_window_pattern")
        if not isinstance(pattern, int) or pattern < 1:
            raise ValueError(
                f"{where}: field 'sliding_window_pattern'={json.dumps(pattern)} is not a "
                "whole number >= 1"
            )
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]  # fmt: skip
    if model_type.startswith("qwen") and not get("use_sliding_window"):
        window = None
    if model_type == "qwen3_moe":  # Qwen3MoeConfig has no layer types: every layer slides
        if window is not None and "max_window_layers" in raw:
            raise ValueError(
                f"{where}: field 'max_window_layers'={json.dumps(raw['max_window_layers'])} "
                "with use_sliding_window true: transformers 5's Qwen3-MoE slides every layer "
                "whatever it says, Qwen's other families keep the layers below it full; kvfence "
                "serves neither guess"
            )
        return (None if window is None else int(window)), ()
    if types is None:
        first = int(get("max_window_layers"))
        types = ["full_attention" if i < first or window is None else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"{where}: field 'layer_types'={json.dumps(types)} is not one of "
            "full_attention or sliding_attention per layer"
        )
    if "sliding_attention" not in types:
        return None, ()
    if window is None:
        raise ValueError(
            f"{where}: field 'layer_types' names sliding_attention layers without a window "
            "(use_sliding_window false or sliding_window null)"
        )
    return int(window), tuple(i for i, t in enumerate(types) if t == "full_attention")
