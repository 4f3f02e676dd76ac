"""A model's shape from its metadata alone — no weights, no torch: what the pool arithmetic
(`kvfence preflight`, the engine's start-up plan) needs, and where the weight loader
(kvfence_engine.loading.loader) keeps its converted GGUF weights."""

import contextlib
import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.loading.tokenizer_source import (
    BUILTINS,
    SMOLLM2,
    TINY_RANDOM,
    gguf_fields,
    smollm2_gguf_path,
)
from kvfence_engine.tools import cache_dir as cache


def load_config(source: str) -> ModelConfig:
    """Only the model's shape, from metadata (no weights): what pool arithmetic needs."""
    if source == SMOLLM2:
        source = str(smollm2_gguf_path())
    if source == TINY_RANDOM:
        return TINY_CONFIG
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        converted = converted_path(path)
        if converted is not None and converted.exists():
            with contextlib.suppress(*UNREADABLE):
                return converted_header(converted)[0]
        from gguf import GGUFReader

        return gguf_config(GGUFReader(str(path)), path)[0]
    if path.is_dir() and (path / "config.json").exists():
        return hf_config(path)
    raise ValueError(f"cannot read model {source!r}: expected one of {', '.join(BUILTINS)}, "
                     "a .gguf file, or a folder with config.json")  # fmt: skip


# Bump when what _convert_gguf produces changes: older cached conversions are then ignored.
CONVERSION = 2  # 2: with the 4-bit tensors' int4 groups
UNREADABLE = (OSError, ValueError, KeyError, TypeError, SafetensorError)


def converted_path(path: Path) -> Path | None:
    root = cache.weights_cache_dir()
    key = cache.file_key(path, f"conversion {CONVERSION}")
    return root / f"weights-{key}.safetensors" if root else None


def converted_header(converted: Path) -> tuple[ModelConfig, str]:
    from safetensors import safe_open

    with safe_open(str(converted), framework="numpy") as f:
        metadata = f.metadata()
    return ModelConfig(**json.loads(metadata["config"])), metadata["name"]


def gguf_config(reader: Any, path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The shape from GGUF metadata, and the metadata itself (the tokenizer lives there)."""
    fields = gguf_fields(reader)
    arch = fields["general.architecture"]
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not a Llama-family decoder")
    heads = int(fields[f"{arch}.attention.head_count"])
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    hidden = int(fields[f"{arch}.embedding_length"])
    tensor_names = {t.name for t in reader.tensors}
    config = ModelConfig(
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(fields[f"{arch}.feed_forward_length"]),
        num_layers=int(fields[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(fields.get(f"{arch}.rope.dimension_count", hidden // heads)),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_positions=int(fields[f"{arch}.context_length"]),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )
    return config, fields


def hf_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / "config.json").read_text())
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        raise ValueError(f"{folder}: architecture {arch} is not a supported Llama-family decoder")
    heads = int(raw["num_attention_heads"])
    config = ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_positions=int(raw.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
    )
    return config


TINY_CONFIG = ModelConfig(
    vocab_size=49152,  # SmolLM2's tokenizer, so tests speak real text
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_eps=1e-5,
    max_positions=4096,
    tie_embeddings=True,
)
