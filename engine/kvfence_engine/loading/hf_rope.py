"""RoPE from a Hugging Face config.json: rope_theta, and the scaling entry under either of its
spellings (`rope_scaling`, with `type` or `rope_type`, as Llama 3.x and Qwen2.5 checkpoints
write it; `rope_parameters`, with rope_theta inside, as transformers 5 saves it). Each variant
accepts exactly the keys transformers reads for it; anything else is refused by name. Gemma 3
gives each kind of layer a RoPE of its own: hf_rope_by_layer_type."""

import json
from typing import Any

from kvfence_engine.core.model_config import RopeScaling, RopeType

# Keys each variant reads (besides rope_type/type and rope_theta), and which must be given.
KEYS: dict[RopeType, set[str]] = {
    RopeType.DEFAULT: set(),
    RopeType.LINEAR: {"factor"},
    RopeType.DYNAMIC: {"factor"},
    RopeType.LLAMA3: {
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
    RopeType.YARN: {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
}
REQUIRED: dict[RopeType, set[str]] = {
    RopeType.LINEAR: {"factor"},
    RopeType.DYNAMIC: {"factor"},
    RopeType.LLAMA3: {"factor", "low_freq_factor", "high_freq_factor"},
    RopeType.YARN: {"factor"},
}
DEFAULT_THETA = 10000.0  # transformers' default_theta, for a config that names none


def hf_rope(raw: dict[str, Any], max_positions: int, where: str) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from config.json's fields; `where` prefixes every refusal."""
    entry = _scaling_entry(raw, where)
    theta = raw.get("rope_theta")
    inner_theta = entry.pop("rope_theta", None)
    if theta is not None and inner_theta is not None and float(theta) != float(inner_theta):
        raise ValueError(
            f"{where}: rope_theta={theta} and rope_theta={inner_theta} inside the rope scaling "
            "entry disagree"
        )
    theta = float(inner_theta if inner_theta is not None else theta or DEFAULT_THETA)
    kind_name = _rope_type(entry, where)
    try:
        kind = RopeType(kind_name)
    except ValueError:
        raise ValueError(
            f"{where}: rope scaling type {kind_name!r} is not supported by kvfence "
            f"(supported: {', '.join(RopeType)})"
        ) from None
    partial = entry.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(
            f"{where}: rope scaling key 'partial_rotary_factor'={partial} changes the "
            "computation and is not implemented"
        )
    unknown = sorted(set(entry) - KEYS[kind])
    if unknown:
        raise ValueError(
            f"{where}: rope scaling key {unknown[0]!r}={entry[unknown[0]]!r} is not one rope "
            f"type {kind.value!r} reads (kvfence reads {sorted(KEYS[kind]) or 'none'})"
        )
    missing = sorted(k for k in REQUIRED.get(kind, set()) if k not in entry)
    if missing:
        raise ValueError(f"{where}: rope scaling type {kind.value!r} needs {missing[0]!r}")
    return theta, _scaling(kind, entry, max_positions)


# Gemma 3's kinds of layer: the field transformers 4 wrote each one's theta in, and
# Gemma3TextConfig's default for it
LAYER_TYPE_THETAS = {
    "full_attention": ("rope_theta", 1_000_000.0),
    "sliding_attention": ("rope_local_base_freq", 10_000.0),
}


def hf_rope_by_layer_type(
    raw: dict[str, Any], max_positions: int, where: str
) -> dict[str, tuple[float, RopeScaling]]:
    """Gemma 3: (rope_theta, scaling) for each kind of layer, under either spelling, as
    Gemma3TextConfig reads them: transformers 4's rope_theta and rope_scaling for the
    full-attention layers and rope_local_base_freq for the sliding ones (default RoPE), or
    transformers 5's rope_parameters keyed by layer type; what is left out takes its default."""
    parameters = raw.get("rope_parameters") or {}
    if not isinstance(parameters, dict) or set(parameters) - set(LAYER_TYPE_THETAS):
        raise ValueError(
            f"{where}: field 'rope_parameters'={json.dumps(parameters)} is not keyed by layer "
            f"type ({' and '.join(LAYER_TYPE_THETAS)}), as Gemma 3's is"
        )
    legacy = {"full_attention": raw.get("rope_scaling")}
    if legacy["full_attention"] and parameters:
        raise ValueError(f"{where}: 'rope_scaling' and 'rope_parameters' are both given")
    ropes = {}
    for layer_type, (theta_field, default_theta) in LAYER_TYPE_THETAS.items():
        named = f"{where}: {layer_type} layers"
        entry = parameters.get(layer_type) or legacy.get(layer_type) or {}
        if not isinstance(entry, dict):
            raise ValueError(f"{named}: rope scaling {entry!r} is not an object")
        inner, outer = entry.get("rope_theta"), raw.get(theta_field)
        if inner is not None and outer is not None and float(inner) != float(outer):
            raise ValueError(
                f"{named}: field {theta_field!r}={outer} and rope_theta={inner} in "
                "rope_parameters disagree"
            )
        theta = next((t for t in (inner, outer) if t is not None), default_theta)
        ropes[layer_type] = hf_rope(
            {"rope_parameters": entry | {"rope_theta": theta}}, max_positions, named
        )
    return ropes


def _scaling_entry(raw: dict[str, Any], where: str) -> dict[str, Any]:
    scaling, parameters = raw.get("rope_scaling"), raw.get("rope_parameters")
    if scaling and parameters and scaling != parameters:
        raise ValueError(f"{where}: 'rope_scaling' and 'rope_parameters' are both given and differ")
    entry = scaling or parameters or {}
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: rope scaling {entry!r} is not an object")
    return dict(entry)


def _rope_type(entry: dict[str, Any], where: str) -> str:
    named = {entry.pop(k) for k in ("rope_type", "type") if k in entry}
    if len(named) > 1:
        raise ValueError(f"{where}: rope scaling 'rope_type' and 'type' disagree: {sorted(named)}")
    return str(named.pop()) if named else RopeType.DEFAULT.value


def _scaling(kind: RopeType, entry: dict[str, Any], max_positions: int) -> RopeScaling:
    """The entry's values, with transformers' defaults where it leaves them out."""
    if kind is RopeType.DEFAULT:
        return RopeScaling()
    original = int(entry.get("original_max_position_embeddings") or max_positions)
    factor = entry["factor"]
    if kind is RopeType.YARN and factor is None:  # DeepSeek-V3's way: the context ratio
        factor = max_positions / original
    if kind is RopeType.LLAMA3:
        return RopeScaling(
            type=kind,
            factor=float(factor),
            original_max_positions=original,
            low_freq_factor=float(entry["low_freq_factor"]),
            high_freq_factor=float(entry["high_freq_factor"]),
        )
    if kind is RopeType.YARN:
        return RopeScaling(
            type=kind,
            factor=float(factor),
            original_max_positions=original,
            attention_factor=_float_or_none(entry.get("attention_factor")),
            beta_fast=float(entry.get("beta_fast") or 32),  # transformers: `or 32`
            beta_slow=float(entry.get("beta_slow") or 1),
            mscale=_float_or_none(entry.get("mscale")),
            mscale_all_dim=_float_or_none(entry.get("mscale_all_dim")),
            truncate=bool(entry.get("truncate", True)),
        )
    return RopeScaling(type=kind, factor=float(factor))  # linear, dynamic


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
