"""Tokenizer and chat template, from GGUF metadata or a tokenizer.json folder."""

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import StrictUndefined
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's token_type values
_CONTROL = 3
_USER_DEFINED = 4


def _raise(message: str) -> None:
    raise TemplateError(message)


@dataclass(slots=True)
class Tokenizer:
    backend: HFTokenizer
    eos_ids: frozenset[int]
    bos_token: str
    eos_token: str
    chat_template: str | None
    # The most characters of text one token stands for; None where the tokenizer may drop or
    # merge characters, so that a prompt's length does not bound its tokens (max_chars_per_token)
    chars_per_token: int | None = field(init=False)
    # The special tokens: what decode skips, and the control tokens a chat's content must never
    # become (kvfence_engine/loading/chat_prompt.py)
    special_ids: frozenset[int] = field(init=False)
    control_strings: tuple[str, ...] = field(init=False)  # their text, longest first
    _text_backend: HFTokenizer | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.chars_per_token = max_chars_per_token(self.backend)
        special = {
            i: t.content for i, t in self.backend.get_added_tokens_decoder().items() if t.special
        }
        self.special_ids = frozenset(special)
        self.control_strings = tuple(sorted(set(special.values()), key=len, reverse=True))

    def encode(self, text: str) -> list[int]:
        """Text as token ids, a special token's text as that token, and nothing added: a
        chat's rendered template (which writes its own BOS where the model wants one)."""
        # encode_batch works without the GIL (encode holds it throughout): a long prompt
        # tokenized on a worker thread must not stop the event loop or the engine thread
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_prompt(self, text: str) -> list[int]:
        """A completion's text prompt as the model's tokenizer encodes one: a special token's
        text as that token (the prompt is the tenant's own to mark up), and the tokens its
        post-processor adds (Llama's and Mistral's BOS; a GGUF's `add_bos_token`), as
        transformers, vLLM and llama.cpp add them."""
        return self.backend.encode_batch([text], add_special_tokens=True)[0].ids

    def encode_text(self, texts: list[str]) -> list[list[int]]:
        """Each text as token ids, a special token's text as the ordinary tokens that spell it,
        never as the special token."""
        if self._text_backend is None:  # a copy, built when first needed (a tenth of a second)
            backend = HFTokenizer.from_str(self.backend.to_str())
            backend.encode_special_tokens = True
            self._text_backend = backend
        return [e.ids for e in self._text_backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined
        )
        env.globals["raise_exception"] = _raise
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


# Steps that never drop or merge characters: normalizers that only add characters or replace
# one for one, pre-tokenizers that only split (unless told to remove what they split on).
_KEEPING_NORMALIZERS = {"Prepend", "NFD", "NFKD", "Lowercase"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def _steps(state: bytes | None) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps, Sequences flattened."""
    pending = [json.loads(state)] if state else []
    steps = []
    while pending:
        step = pending.pop()
        if step["type"] == "Sequence":
            pending += step.get("normalizers", step.get("pretokenizers", []))
        else:
            steps.append(step)
    return steps


def _keeps_every_character(step: dict[str, Any], kinds: set[str]) -> bool:
    if step["type"] == "Replace":  # a plain string by one at least as long
        pattern = step["pattern"].get("String")
        return pattern is not None and len(step["content"]) >= len(pattern)
    return step["type"] in kinds and step.get("behavior") != "Removed"


def max_chars_per_token(backend: HFTokenizer) -> int | None:
    """The most characters of text one token can stand for: the longest vocabulary entry, so a
    prompt of more than `context * this` characters cannot fit `context` tokens.

    It holds for a BPE that keeps every character of its input and has a token for every byte
    (byte-level, or byte fallback), where no unknown token swallows a run of characters: each
    token then covers at most its own length of text (a byte-level entry spells one character
    per byte, and a character is at least one byte). A byte the vocabulary lacks (SmolLM2 has
    none for a few control characters) is dropped, not merged: a prompt padded with them is
    refused rather than shrunk. None for any other tokenizer."""
    model = backend.model
    normalizers = _steps(backend.normalizer.__getstate__() if backend.normalizer else None)
    pre = _steps(backend.pre_tokenizer.__getstate__() if backend.pre_tokenizer else None)
    byte_level = any(step["type"] == "ByteLevel" for step in pre)
    if not (
        isinstance(model, models.BPE)
        and (byte_level or model.byte_fallback)
        and all(_keeps_every_character(step, _KEEPING_NORMALIZERS) for step in normalizers)
        and all(_keeps_every_character(step, _KEEPING_PRE_TOKENIZERS) for step in pre)
    ):
        return None
    return max(map(len, backend.get_vocab(with_added_tokens=True)))


# The splits before the byte-level BPE of the vocabularies whose GGUF pre-tokenizer
# (`tokenizer.ggml.pre`, llama.cpp's name) kvfence knows: the regexes of the tokenizer.json
# files the vocabularies come with. Llama 3's keeps runs of up to three digits; Qwen2's (also
# Qwen2.5's and Qwen3's) splits every digit.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
GGUF_PRE_TOKENIZERS = ("smollm", "starcoder", "refact", "gpt-2", "default", *_SPLITS)


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        # GPT-2 regex, with every digit its own pre-token (llama.cpp's smollm/starcoder)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt-2", "gpt2", "default"):
        return byte_level
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated")
        bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, bytes_only])
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(GGUF_PRE_TOKENIZERS)})"
    )


def _gguf_flag(fields: dict[str, Any], key: str, default: bool) -> bool:
    value = fields.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"GGUF {key} must be a boolean, got {value!r}")
    return value


def tokenizer_from_gguf(fields: dict[str, Any]) -> Tokenizer:
    """Build a byte-level BPE from a GGUF file's tokenizer.ggml.* metadata."""
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    special = [
        tok for tok, kind in zip(tokens, types, strict=True) if kind in (_CONTROL, _USER_DEFINED)
    ]
    backend.add_special_tokens(special)
    bos = int(fields.get("tokenizer.ggml.bos_token_id", 0))
    eos = int(fields["tokenizer.ggml.eos_token_id"])
    # llama.cpp adds BOS to a prompt when the file says so (absent: no, for a BPE vocabulary)
    if _gguf_flag(fields, "tokenizer.ggml.add_bos_token", False):
        if "tokenizer.ggml.bos_token_id" not in fields:
            raise ValueError("GGUF tokenizer.ggml.add_bos_token=true names no bos_token_id")
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0",
            pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)],
        )
    if _gguf_flag(fields, "tokenizer.ggml.add_eos_token", False):
        raise ValueError(
            "GGUF tokenizer.ggml.add_eos_token=true is not supported (a prompt ending in EOS)"
        )
    return Tokenizer(
        backend=backend,
        eos_ids=frozenset({eos}),
        bos_token=tokens[bos],
        eos_token=tokens[eos],
        chat_template=fields.get("tokenizer.chat_template"),
    )


def tokenizer_data(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tokenizers model plus what the engine adds (eos, template), as JSON values: what
    the cache file holds and what an engine serves its router (GET /internal/v1/tokenizer)."""
    return {
        "tokenizer": json.loads(tokenizer.backend.to_str()),
        "eos_ids": sorted(tokenizer.eos_ids),
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "chat_template": tokenizer.chat_template,
    }


def tokenizer_of_data(data: dict[str, Any]) -> Tokenizer:
    """The inverse of tokenizer_data; KeyError, TypeError or ValueError for anything else."""
    return Tokenizer(
        backend=HFTokenizer.from_str(json.dumps(data["tokenizer"])),
        eos_ids=frozenset(data["eos_ids"]),
        bos_token=data["bos_token"],
        eos_token=data["eos_token"],
        chat_template=data["chat_template"],
    )


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """One JSON file: tokenizer_data. Written under a name of this process's and renamed: a
    reader never sees half a file, and two processes saving at once never mix their writes."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps(tokenizer_data(tokenizer)))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def load_saved_tokenizer(path: Path) -> Tokenizer:
    return tokenizer_of_data(json.loads(path.read_text()))


def tokenizer_from_folder(folder: Path, eos_ids: Sequence[int] = ()) -> Tokenizer:
    """tokenizer.json (+ tokenizer_config.json for the chat template and special tokens)."""
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}

    def token_str(value: object) -> str:
        if isinstance(value, dict):
            return str(value.get("content", ""))
        return str(value or "")

    bos_token = token_str(config.get("bos_token"))
    eos_token = token_str(config.get("eos_token"))
    ids = set(eos_ids)
    eos_id = backend.token_to_id(eos_token) if eos_token else None
    if eos_id is not None:
        ids.add(eos_id)
    if not ids:
        raise ValueError(
            f"{folder}: no eos token in tokenizer_config.json, config.json or "
            "generation_config.json"
        )
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(backend, frozenset(ids), bos_token, eos_token, template)
