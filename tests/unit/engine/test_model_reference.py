"""Our decoder against Hugging Face transformers on the same weights.

Tolerances: fp32 on both sides, different kernels (fused projections, SDPA, paged gather), so
logits agree to float rounding: max |diff| <= 1e-3 for SmolLM2 (logits of magnitude ~20),
<= 1e-4 for the tiny model.
"""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from helpers.transformers_reference import our_greedy, our_prefill_logits, their_greedy
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.loading.loader import (
    LoadedModel,
    load_hf_folder,
    load_model,
    tiny_random,
)
from kvfence_engine.loading.tokenizer_source import smollm2_gguf_path


def save_hf_folder(loaded: LoadedModel, folder: Path) -> None:
    c = loaded.config
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads,
                "head_dim": c.head_dim,
                "rope_theta": c.rope_theta,
                "rms_norm_eps": c.rms_eps,
                "max_position_embeddings": c.max_positions,
                "tie_word_embeddings": c.tie_embeddings,
                "hidden_act": "silu",
                "bos_token_id": 1,
                "eos_token_id": 2,
                "torch_dtype": "float32",
            }
        )
    )
    save_file(
        {k: v.contiguous() for k, v in loaded.weights.items()}, str(folder / "model.safetensors")
    )
    loaded.tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": loaded.tokenizer.bos_token,
                "eos_token": loaded.tokenizer.eos_token,
                "chat_template": loaded.tokenizer.chat_template,
            }
        )
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-hf")
    save_hf_folder(tiny_random(), folder)
    return folder


def test_a_safetensors_folder_loads_with_its_tokenizer_and_template(tiny_folder: Path) -> None:
    loaded = load_hf_folder(tiny_folder)
    reference = tiny_random()
    assert loaded.config == reference.config
    assert loaded.tokenizer.encode("Hello, world 123") == reference.tokenizer.encode(
        "Hello, world 123"
    )
    assert loaded.tokenizer.eos_ids == frozenset({2})
    assert "<|im_start|>assistant" in loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )


def test_tiny_model_logits_match_transformers_on_the_same_safetensors(tiny_folder: Path) -> None:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    engine = LLMEngine(load_hf_folder(tiny_folder), EngineArgs(kv_cache_memory=8 * 1024**2))
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0]
    ours = our_prefill_logits(engine, ids)
    assert (ours - expected).abs().max().item() <= 1e-4
    engine = LLMEngine(load_hf_folder(tiny_folder), EngineArgs(kv_cache_memory=8 * 1024**2))
    tokens, logprobs = our_greedy(engine, ids, 12)
    ref_tokens, ref_logprobs = their_greedy(theirs, ids, 12)
    assert tokens[: len(ref_tokens)] == ref_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=False)) <= 1e-4


@pytest.mark.slow
def test_smollm2_logits_match_transformers_on_the_same_gguf() -> None:
    gguf = smollm2_gguf_path()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    loaded = load_model("builtin:smollm2-135m-instruct")
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    # the float path (the default for this file is its int4 blocks: test_int8_weights.py)
    engine = LLMEngine(loaded, EngineArgs(kv_cache_memory=64 * 1024**2, weight_dtype="float32"))
    ids = engine.tokenizer.encode(prompt)
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    ours = our_prefill_logits(engine, ids)
    assert (ours - expected).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    engine = LLMEngine(
        load_model("builtin:smollm2-135m-instruct"),
        EngineArgs(kv_cache_memory=64 * 1024**2, weight_dtype="float32"),
    )
    tokens, logprobs = our_greedy(engine, ids, 10)
    ref_tokens, ref_logprobs = their_greedy(theirs, ids, 10)
    assert tokens[: len(ref_tokens)] == ref_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=False)) <= 1e-3
    assert "Paris" in engine.tokenizer.decode(tokens)
