"""Resolve a model source (SRC) into a config, float weights in Hugging Face names, and a tokenizer;
for a GGUF, also the file's own Q4_0/Q4_1 blocks (int4), which the engine packs by default on CPU.

SRC is `builtin:smollm2-135m-instruct`, `builtin:tiny-random`, a `.gguf` file, or a folder with
config.json + *.safetensors (one file, or shards and their index: hf_weights.py) +
tokenizer.json, and perhaps generation_config.json (its eos ids: generation_config.py).

A load is planned before it runs (plan_load): its named steps, known from the source and the
cache, are what `kvfence serve` counts on /readyz while it loads.
"""

import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.quantization import GROUP, Int4Groups
from kvfence_engine.loading.config import (
    TINY_CONFIG,
    UNREADABLE,
    converted_header,
    converted_path,
    source_error,
)
from kvfence_engine.loading.generation_config import (
    GENERATION_CONFIG,
    folder_eos_ids,
    read_generation_config,
)
from kvfence_engine.loading.gguf_config import ROPE_FREQS, gguf_config, hf_name
from kvfence_engine.loading.hf_config import hf_config
from kvfence_engine.loading.hf_weights import load_hf_weights
from kvfence_engine.loading.tokenizer import Tokenizer, tokenizer_from_folder, tokenizer_from_gguf
from kvfence_engine.loading.tokenizer_source import (
    SMOLLM2,
    TINY_RANDOM,
    gguf_tokenizer,
    remember_tokenizer,
    smollm2_gguf_path,
    smollm2_tokenizer,
)
from kvfence_engine.tools.progress import Progress

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str = ""  # as given to load_model: what /v1/kvpool reports, for the router
    # a GGUF's Q4_0/Q4_1 tensors as the file holds them (weights has their dequantization too)
    int4: dict[str, Int4Groups] = field(default_factory=dict)


Step = Callable[[str], None]  # told each named step of a load as it starts


def _silent(step: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """How a source will load, decided once: its named steps in order (what a progress display
    counts: `kvfence serve` shows them on /readyz) and the load itself, which tells `step`
    each one as it starts. A cache entry found unreadable on the way is converted again, in
    steps beyond the plan."""

    steps: tuple[str, ...]
    run: Callable[[Step], "LoadedModel"]


def load_model(source: str, step: Step = _silent) -> LoadedModel:
    return plan_load(source).run(step)


def plan_load(source: str) -> LoadPlan:
    """The steps and the load of `source` (load_model: the same, run at once)."""
    plan = _plan(source)

    def run(step: Step) -> LoadedModel:
        loaded = plan.run(step)
        loaded.source = source
        return loaded

    return LoadPlan(plan.steps, run)


def _plan(source: str) -> LoadPlan:
    if source == SMOLLM2:
        return _gguf_plan(smollm2_gguf_path(), name="smollm2-135m-instruct")
    if source == TINY_RANDOM:
        return _one_step("generating the tiny random weights", tiny_random)
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_plan(path)
    if path.is_dir() and (path / "config.json").exists():
        return _one_step(f"reading {path.name}'s safetensors", lambda: load_hf_folder(path))
    raise source_error(source, "load", "config.json + *.safetensors + tokenizer.json")


def _one_step(name: str, load: Callable[[], "LoadedModel"]) -> LoadPlan:
    def run(step: Step) -> LoadedModel:
        step(name)
        return load()

    return LoadPlan((name,), run)


# --- GGUF -------------------------------------------------------------------------------------


def _unpermute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation so rotate-half RoPE (HF layout) applies."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def int4_groups(raw: np.ndarray, kind: object) -> Int4Groups:
    """A Q4_0 or Q4_1 tensor's blocks (uint8 [N, bytes per row], as gguf reads them) in the int4
    kernel's terms, w = (q - 8) * scale + zero, exactly the file's weights: a block is fp16 d
    (Q4_1: then fp16 m) and 16 bytes, low nibbles the first 16 weights, high the last 16.
    Q4_0: w = d * (q - 8), so zero 0; Q4_1: w = d * q + m, so zero m + 8 d (exact in float32:
    d and m are fp16)."""
    from gguf import GGMLQuantizationType

    q4_1 = kind == GGMLQuantizationType.Q4_1
    if not q4_1 and kind != GGMLQuantizationType.Q4_0:
        raise ValueError(f"not a 4-bit block type: {kind}")
    header = 4 if q4_1 else 2
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, header + GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., header:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(raw.shape[0], -1)
    if q4_1:
        zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
    else:
        zero = np.zeros_like(d)
    return Int4Groups(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


def load_gguf(path: Path, name: str | None = None) -> LoadedModel:
    """A GGUF model, dequantized to float32, and its 4-bit tensors as the file holds them.
    Parsing and dequantizing take seconds (the header
    alone holds the whole vocabulary), so the converted weights are kept in the cache as
    safetensors, keyed by the file and CONVERSION; a cache that cannot be read is rebuilt."""
    return _gguf_plan(path, name).run(_silent)


CACHE_READ_STEP = "reading the converted weights from the cache"
SAVE_STEP = "saving the converted weights to the cache"


def _gguf_plan(path: Path, name: str | None = None) -> LoadPlan:
    """From the cache when it holds this file's conversion (one step), else converted: the
    header read, the tensors dequantized (a counted progress of its own), the tokenizer built,
    and, where there is a cache, the conversion saved (a whole model written: seconds)."""
    converted = converted_path(path)

    def convert(step: Step) -> LoadedModel:
        loaded = _convert_gguf(path, step)
        if converted is not None:
            step(SAVE_STEP)
            with contextlib.suppress(OSError):
                _save_converted(loaded, converted)
        if name is not None:
            loaded.name = name
        return loaded

    if converted is not None and converted.exists():

        def cached(step: Step) -> LoadedModel:
            step(CACHE_READ_STEP)
            with contextlib.suppress(*UNREADABLE):
                return _load_converted(converted, path, name)
            return convert(step)

        return LoadPlan((CACHE_READ_STEP,), cached)
    saving = (SAVE_STEP,) if converted is not None else ()
    return LoadPlan((*convert_steps(path), *saving), convert)


def convert_steps(path: Path) -> tuple[str, str, str]:
    """The named steps of `_convert_gguf`, in order."""
    return (
        f"reading {path.name} (header and vocabulary)",
        "dequantizing the weights",
        "building the tokenizer",
    )


def _save_converted(loaded: LoadedModel, target: Path) -> None:
    """Written under a temporary name and renamed: a reader never sees half a file, and two
    engines converting at once both succeed."""
    from safetensors.torch import save_file

    metadata = {"name": loaded.name, "config": json.dumps(dataclasses.asdict(loaded.config))}
    tensors = dict(loaded.weights)
    for key, groups in loaded.int4.items():
        tensors |= {f"{key}{INT4_SUFFIX}{part}": getattr(groups, part) for part in INT4_PARTS}
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _load_converted(converted: Path, path: Path, name: str | None) -> LoadedModel:
    from safetensors.torch import load_file

    config, stored_name = converted_header(converted)
    # load_file maps the file; copies in anonymous memory cannot be evicted under memory
    # pressure and re-read from disk in the middle of serving.
    weights = {key: tensor.clone() for key, tensor in load_file(str(converted)).items()}
    int4 = {
        key.removesuffix(f"{INT4_SUFFIX}q"): Int4Groups(
            *(weights.pop(key.removesuffix("q") + part) for part in INT4_PARTS)
        )
        for key in [k for k in weights if k.endswith(f"{INT4_SUFFIX}q")]
    }
    return LoadedModel(
        name=name or stored_name,
        config=config,
        weights=weights,
        tokenizer=gguf_tokenizer(path),
        int4=int4,
    )


INT4_SUFFIX = ":int4."  # cache keys of a tensor's int4 groups: NAME:int4.q, .scale, .zero
INT4_PARTS = ("q", "scale", "zero")


def _convert_gguf(path: Path, step: Step = _silent) -> LoadedModel:
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reading, dequantizing, tokenizing = convert_steps(path)
    step(reading)
    reader = GGUFReader(str(path))
    config, fields = gguf_config(reader, path)
    step(dequantizing)
    arch = fields["general.architecture"]
    weights: dict[str, torch.Tensor] = {}
    int4: dict[str, Int4Groups] = {}
    four_bit = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
    # the slow part of a first start (seconds to minutes): a bar on a terminal, a line in the
    # log every tenth of the way otherwise, and the engine's /readyz says where it is
    with Progress(
        f"converting {path.name}",
        len(reader.tensors),
        unit="tensor",
        stream=sys.stderr,
        write=log.info,
    ) as converting:
        for tensor in reader.tensors:
            if tensor.name == ROPE_FREQS:  # read into config.rope by gguf_config
                converting.advance()
                continue
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            array = array.reshape(tuple(reversed([int(d) for d in tensor.shape])))
            groups = None
            if tensor.tensor_type in four_bit and array.ndim == 2:
                groups = int4_groups(np.asarray(tensor.data), tensor.tensor_type)
            # llama.cpp permutes Q/K only for the llama architecture (qwen2 keeps HF layout).
            part = tensor.name.split(".")[-2]
            if arch == "llama" and part in ("attn_q", "attn_k"):
                n = config.num_heads if part == "attn_q" else config.num_kv_heads
                array = _unpermute_rope(array, n)
                if groups is not None:  # rows move whole: each row's blocks go with it
                    groups = Int4Groups(
                        *(torch.from_numpy(_unpermute_rope(getattr(groups, p).numpy(), n).copy())
                          for p in INT4_PARTS)
                    )  # fmt: skip
            weights[hf_name(tensor.name)] = torch.from_numpy(np.array(array, dtype=np.float32))
            if groups is not None:
                int4[hf_name(tensor.name)] = groups
            converting.advance()
    step(tokenizing)
    return LoadedModel(
        name=str(fields.get("general.name", path.stem)),
        config=config,
        weights=weights,
        tokenizer=remember_tokenizer(path, tokenizer_from_gguf(fields)),
        int4=int4,
    )


# --- Hugging Face folder ---


def load_hf_folder(folder: Path) -> LoadedModel:
    config = hf_config(folder)
    weights = load_hf_weights(folder)
    generation = read_generation_config(folder)
    if generation.not_applied:
        log.info(
            "%s: request defaults not applied (a request's own values apply, else the OpenAI "
            "API's defaults): %s",
            GENERATION_CONFIG,
            ", ".join(f"{k}={v!r}" for k, v in generation.not_applied.items()),
        )
    return LoadedModel(
        name=folder.name,
        config=config,
        weights=weights,
        tokenizer=tokenizer_from_folder(folder, folder_eos_ids(folder)),
    )


# --- tiny random ------------------------------------------------------------------------------


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
