"""A model's shape from its metadata alone — no weights, no torch: what the pool arithmetic
(`kvfence preflight`, the engine's start-up plan) needs, and where the weight loader
(kvfence_engine.loading.loader) keeps its converted GGUF weights."""

import contextlib
import json
from pathlib import Path

from safetensors import SafetensorError

from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.loading.gguf_config import gguf_config
from kvfence_engine.loading.hf_config import hf_config
from kvfence_engine.loading.tokenizer_source import (
    BUILTINS,
    SMOLLM2,
    TINY_RANDOM,
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
    raise source_error(source, "read", "config.json")


def source_error(source: str, verb: str, folder_holds: str) -> ValueError:
    """Why `source` names no model, in the words that fix it: a path that does not exist says
    so (it is the usual mistake: a path on the machine that is not in the container), a folder
    says what it lacks; only a source that is none of these lists what a source may be.
    `folder_holds`: what a model folder needs, for the reader of `verb` (read: its config.json;
    load: its weights and tokenizer too)."""
    path = Path(source)
    if not source.startswith("builtin:") and not path.exists():
        kind = "file" if path.suffix == ".gguf" else "file or folder"
        return ValueError(
            f"cannot {verb} model {source!r}: no such {kind} (on a cluster the path is inside "
            "the engine container: put the model there with spec.model.volume)"
        )
    if path.is_dir():
        return ValueError(f"cannot {verb} model {source!r}: the folder has no config.json")
    return ValueError(
        f"cannot {verb} model {source!r}: expected one of {', '.join(BUILTINS)}, a .gguf "
        f"file, or a folder with {folder_holds}"
    )


# Bump when what _convert_gguf produces changes: older cached conversions are then ignored.
CONVERSION = 3  # 2: with the 4-bit tensors' int4 groups; 3: family and rope scaling
UNREADABLE = (OSError, ValueError, KeyError, TypeError, SafetensorError)


def converted_path(path: Path) -> Path | None:
    root = cache.weights_cache_dir()
    key = cache.file_key(path, f"conversion {CONVERSION}")
    return root / f"weights-{key}.safetensors" if root else None


def converted_header(converted: Path) -> tuple[ModelConfig, str]:
    from safetensors import safe_open

    with safe_open(str(converted), framework="numpy") as f:
        metadata = f.metadata()
    return ModelConfig.from_dict(json.loads(metadata["config"])), metadata["name"]


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
