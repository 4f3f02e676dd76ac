"""RoPE from a Hugging Face config.json: rope_theta, and the scaling entry under either of its
spellings (`rope_scaling`, with `type` or `rope_type`, as Llama 3.x and Qwen2.5 checkpoints
write it; `rope_parameters`, with rope_theta inside, as transformers 5 saves it). Each variant
accepts exactly the keys transformers reads for it; anything else is refused by name. What
differs by family (the variants its model computes, keys its config class keeps at the top
level of config.json, as Phi-3's does): RopeRules. Gemma 3 gives each kind of layer a RoPE
of its own: hf_rope_by_layer_type."""

import json
from dataclasses import dataclass, field, replace
from typing import Any

from kvfence_engine.core.model_config import RopeScaling, RopeType


@dataclass(frozen=True, slots=True)
class RopeRules:
    """types: the variants the family's transformers model computes (and kvfence checked);
    aliases: older names of them; top_level: rope keys the config class also reads at the top
    of config.json, with its default where config.json leaves them out (None: no default);
    the entry's value and the top level's must agree. partial_rotary: partial_rotary_factor
    is implemented (elsewhere it must be 1)."""

    types: frozenset[RopeType]
    aliases: dict[str, RopeType] = field(default_factory=dict)
    top_level: dict[str, Any] = field(default_factory=dict)
    partial_rotary: bool = False


STANDARD = RopeRules(frozenset(RopeType) - {RopeType.LONGROPE, RopeType.FREQ_FACTORS})

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
    RopeType.LONGROPE: {
        "short_factor",
        "long_factor",
        "factor",
        "attention_factor",
        "original_max_position_embeddings",
    },
}
REQUIRED: dict[RopeType, set[str]] = {
    RopeType.LINEAR: {"factor"},
    RopeType.DYNAMIC: {"factor"},
    RopeType.LLAMA3: {"factor", "low_freq_factor", "high_freq_factor"},
    RopeType.YARN: {"factor"},
    RopeType.LONGROPE: {"short_factor", "long_factor"},
}
PARTIAL = "partial_rotary_factor"
DEFAULT_THETA = 10000.0  # transformers' default_theta, for a config that names none


def hf_rope(
    raw: dict[str, Any], max_positions: int, where: str, rules: RopeRules = STANDARD
) -> tuple[float, RopeScaling]:
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
    kind = rules.aliases.get(kind_name) or next((t for t in RopeType if t == kind_name), None)
    if kind is None or kind not in rules.types:
        supported = ", ".join(t for t in RopeType if t in rules.types)
        raise ValueError(
            f"{where}: rope scaling type {kind_name!r} is not supported by kvfence "
            f"(supported: {supported})"
        )
    _merge_top_level(raw, entry, rules, KEYS[kind] | {PARTIAL}, where)
    partial = entry.pop(PARTIAL, 1.0)
    if partial != 1.0 and not rules.partial_rotary:
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
    scaling = _scaling(kind, entry, max_positions, where)
    return theta, replace(scaling, partial_rotary_factor=float(partial))


def check_rotary_dims(scaling: RopeScaling, head_dim: int, where: str) -> None:
    """The rotated dims must pair up, and longrope needs one factor per pair."""
    dim = scaling.rotary_dim(head_dim)
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(
            f"{where}: rope scaling key 'partial_rotary_factor'={scaling.partial_rotary_factor} "
            f"rotates {dim} of the {head_dim} head dims; kvfence rotates an even number of "
            "them, at least two"
        )
    if scaling.type is RopeType.LONGROPE:
        for key in ("short_factor", "long_factor"):
            count = len(getattr(scaling, key))
            if count != dim // 2:
                raise ValueError(
                    f"{where}: rope scaling key {key!r} has {count} values; the {dim} rotated "
                    f"dims of a head take {dim // 2}"
                )


def _merge_top_level(
    raw: dict[str, Any], entry: dict[str, Any], rules: RopeRules, reads: set[str], where: str
) -> None:
    """The family's top-level rope keys (this variant's only) into the entry, as its config
    class moves them there; one given twice must be given alike."""
    for key, default in rules.top_level.items():
        top = raw.get(key, default)
        if key not in reads or top is None:
            continue
        inner = entry.setdefault(key, top)
        if inner != top:
            given = "" if key in raw else " (its default where config.json leaves it out)"
            raise ValueError(
                f"{where}: rope scaling key {key!r}={json.dumps(inner)} and the field "
                f"{key!r}={json.dumps(top)}{given} disagree"
            )


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


def _scaling(kind: RopeType, entry: dict[str, Any], max_positions: int, where: str) -> RopeScaling:
    """The entry's values, with transformers' defaults where it leaves them out."""
    if kind is RopeType.DEFAULT:
        return RopeScaling()
    original = int(entry.get("original_max_position_embeddings") or max_positions)
    factor: Any = entry.get("factor")  # required but by yarn and longrope
    if kind in (RopeType.YARN, RopeType.LONGROPE) and factor is None:  # the context ratio
        factor = max_positions / original
    scaled = RopeScaling(type=kind, factor=float(factor), original_max_positions=original)
    if kind is RopeType.LONGROPE:
        return replace(
            scaled,
            attention_factor=_float_or_none(entry.get("attention_factor")),
            short_factor=_numbers(entry, "short_factor", where),
            long_factor=_numbers(entry, "long_factor", where),
        )
    if kind is RopeType.LLAMA3:
        return replace(
            scaled,
            low_freq_factor=float(entry["low_freq_factor"]),
            high_freq_factor=float(entry["high_freq_factor"]),
        )
    if kind is RopeType.YARN:
        return replace(
            scaled,
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


def _numbers(entry: dict[str, Any], key: str, where: str) -> tuple[float, ...]:
    values = entry[key]
    if not isinstance(values, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(
            f"{where}: rope scaling key {key!r}={json.dumps(values)} is not a list of numbers"
        )
    return tuple(float(v) for v in values)
