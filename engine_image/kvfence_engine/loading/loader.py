"""Resolve a model source (SRC) into a config, float weights in Hugging Face names, and a tokenizer.

SRC is `builtin:smollm2-135m-instruct`, `builtin:tiny-random`, a `.gguf` file, or a folder with
config.json + *.safetensors + tokenizer.json.
"""

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.loading.tokenizer import Tokenizer, tokenizer_from_folder, tokenizer_from_gguf
from kvfence_engine.loading.tokenizer_source import (
    BUILTINS,
    SMOLLM2,
    TINY_RANDOM,
    eos_ids,
    gguf_fields,
    gguf_tokenizer,
    remember_tokenizer,
    smollm2_gguf_path,
    smollm2_tokenizer,
)
from kvfence_engine.tools import cache_dir as cache


@dataclass(slots=True)
class LoadedModel:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer


def load_model(source: str) -> LoadedModel:
    if source == SMOLLM2:
        return load_gguf(smollm2_gguf_path(), name="smollm2-135m-instruct")
    if source == TINY_RANDOM:
        return tiny_random()
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_folder(path)
    raise ValueError(
        f"cannot load model {source!r}: expected one of {', '.join(BUILTINS)}, a .gguf file, "
        "or a folder with config.json + *.safetensors + tokenizer.json"
    )


def load_config(source: str) -> ModelConfig:
    """Only the model's shape, from metadata (no weights): what pool arithmetic needs."""
    if source == SMOLLM2:
        source = str(smollm2_gguf_path())
    if source == TINY_RANDOM:
        return TINY_CONFIG
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        converted = _converted_path(path)
        if converted is not None and converted.exists():
            with contextlib.suppress(*_UNREADABLE):
                return _converted_header(converted)[0]
        from gguf import GGUFReader

        return _gguf_config(GGUFReader(str(path)), path)[0]
    if path.is_dir() and (path / "config.json").exists():
        return _hf_config(path)
    raise ValueError(f"cannot read model {source!r}: expected one of {', '.join(BUILTINS)}, "
                     "a .gguf file, or a folder with config.json")  # fmt: skip


# --- GGUF -------------------------------------------------------------------------------------


def _unpermute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation so rotate-half RoPE (HF layout) applies."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, part, kind = gguf_name.split(".")
    return f"model.layers.{layer}.{_GGUF_NAMES[part]}.{kind}"


def _gguf_config(reader: Any, path: Path) -> tuple[ModelConfig, dict[str, Any]]:
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


def load_gguf(path: Path, name: str | None = None) -> LoadedModel:
    """A GGUF model, dequantized to float32. Parsing and dequantizing take seconds (the header
    alone holds the whole vocabulary), so the converted weights are kept in the cache as
    safetensors, keyed by the file and CONVERSION; a cache that cannot be read is rebuilt."""
    converted = _converted_path(path)
    if converted is not None and converted.exists():
        with contextlib.suppress(*_UNREADABLE):
            return _load_converted(converted, path, name)
    loaded = _convert_gguf(path)
    if converted is not None:
        with contextlib.suppress(OSError):
            _save_converted(loaded, converted)
    if name is not None:
        loaded.name = name
    return loaded


# Bump when what _convert_gguf produces changes: older cached conversions are then ignored.
CONVERSION = 1
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, SafetensorError)


def _converted_path(path: Path) -> Path | None:
    root = cache.writable_cache_dir()
    key = cache.file_key(path, f"conversion {CONVERSION}")
    return root / f"weights-{key}.safetensors" if root else None


def _save_converted(loaded: LoadedModel, target: Path) -> None:
    """Written under a temporary name and renamed: a reader never sees half a file, and two
    engines converting at once both succeed."""
    from safetensors.torch import save_file

    metadata = {"name": loaded.name, "config": json.dumps(dataclasses.asdict(loaded.config))}
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        save_file(loaded.weights, str(partial), metadata=metadata)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _converted_header(converted: Path) -> tuple[ModelConfig, str]:
    from safetensors import safe_open

    with safe_open(str(converted), framework="pt") as f:
        metadata = f.metadata()
    return ModelConfig(**json.loads(metadata["config"])), metadata["name"]


def _load_converted(converted: Path, path: Path, name: str | None) -> LoadedModel:
    from safetensors.torch import load_file

    config, stored_name = _converted_header(converted)
    # load_file maps the file; copies in anonymous memory cannot be evicted under memory
    # pressure and re-read from disk in the middle of serving.
    weights = {key: tensor.clone() for key, tensor in load_file(str(converted)).items()}
    return LoadedModel(
        name=name or stored_name, config=config, weights=weights, tokenizer=gguf_tokenizer(path)
    )


def _convert_gguf(path: Path) -> LoadedModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    config, fields = _gguf_config(reader, path)
    arch = fields["general.architecture"]
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(tuple(reversed([int(d) for d in tensor.shape])))
        # llama.cpp permutes Q/K only for the llama architecture (qwen2 keeps HF layout).
        if arch == "llama" and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
            n = config.num_heads if tensor.name.split(".")[-2] == "attn_q" else config.num_kv_heads
            array = _unpermute_rope(array, n)
        weights[_hf_name(tensor.name)] = torch.from_numpy(np.array(array, dtype=np.float32))
    return LoadedModel(
        name=str(fields.get("general.name", path.stem)),
        config=config,
        weights=weights,
        tokenizer=remember_tokenizer(path, tokenizer_from_gguf(fields)),
    )


# --- Hugging Face folder ---


def _hf_config(folder: Path) -> ModelConfig:
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


def load_hf_folder(folder: Path) -> LoadedModel:
    from safetensors.torch import load_file

    config = _hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update({k: v.float() for k, v in load_file(str(file)).items()})
    return LoadedModel(
        name=folder.name,
        config=config,
        weights=weights,
        tokenizer=tokenizer_from_folder(
            folder, eos_ids(json.loads((folder / "config.json").read_text()))
        ),
    )


# --- tiny random ------------------------------------------------------------------------------


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


def tiny_random(seed: int = 0) -> LoadedModel:
    """A seeded few-layer model: same weights every time, fast enough for every test."""
    c = TINY_CONFIG
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size, scale=1.0)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(c.hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(c.hidden_size),
            p + "self_attn.q_proj.weight": rand(c.num_heads * c.head_dim, c.hidden_size),
            p + "self_attn.k_proj.weight": rand(c.num_kv_heads * c.head_dim, c.hidden_size),
            p + "self_attn.v_proj.weight": rand(c.num_kv_heads * c.head_dim, c.hidden_size),
            p + "self_attn.o_proj.weight": rand(c.hidden_size, c.num_heads * c.head_dim),
            p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size),
        }
    weights["model.norm.weight"] = torch.ones(c.hidden_size)
    return LoadedModel("tiny-random", c, weights, smollm2_tokenizer())
