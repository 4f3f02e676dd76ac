"""A Hugging Face folder's generation_config.json: what the model's authors suggest a request
default to. It is not the model (nothing in it changes what the weights compute), so a field
kvfence does not apply is never a reason to refuse the model.

kvfence reads one field, `eos_token_id`: an id or a list of them (Llama 3.x instruct lists
[128001, 128008, 128009], Qwen2.5 [151645, 151643]), each of which ends generation as the
tokenizer's eos does (unless the request sets ignore_eos). It takes none of the sampling
defaults (`temperature`, `top_p`, `top_k`, `repetition_penalty`, `min_p`, `do_sample`,
`max_new_tokens`...) as vLLM's `--generation-config auto` does: a request's defaults stay the
OpenAI API's whatever the folder, as llama.cpp's server keeps its own. kvfence implements only
some of them (not `repetition_penalty` or `min_p`, which Qwen2.5 and Qwen3 set), and applying
the rest would serve half the authors' advice as if it were all of it. The loader logs the
fields it leaves to the requests. No torch: the router reads the eos ids too."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"
# Not request defaults: provenance, and the token ids (eos is read; bos and pad mean nothing
# to a request)
NOT_DEFAULTS = frozenset(
    {"_from_model_config", "transformers_version", "bos_token_id", "pad_token_id", "eos_token_id"}
)


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    eos_ids: tuple[int, ...] = ()
    not_applied: dict[str, Any] = field(default_factory=dict)  # the request defaults it names


def read_generation_config(folder: Path) -> GenerationConfig:
    path = folder / GENERATION_CONFIG
    if not path.exists():
        return GenerationConfig()
    raw = read_json_object(path)
    defaults = {k: v for k, v in raw.items() if k not in NOT_DEFAULTS}
    return GenerationConfig(eos_token_ids(raw, GENERATION_CONFIG), defaults)


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path.name}: not a JSON object")
    return raw


def eos_token_ids(raw: dict[str, Any], file: str) -> tuple[int, ...]:
    """A config's eos_token_id, one or several (or none)."""
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: field 'eos_token_id'={eos!r} is not a token id or a list of ids")
    return tuple(ids)


def folder_eos_ids(folder: Path) -> tuple[int, ...]:
    """Every id that ends generation by the folder's configs: config.json's eos_token_id and
    generation_config.json's (the tokenizer's own eos token joins them)."""
    config = folder / "config.json"
    from_config = eos_token_ids(read_json_object(config), config.name) if config.exists() else ()
    return tuple(dict.fromkeys((*from_config, *read_generation_config(folder).eos_ids)))
