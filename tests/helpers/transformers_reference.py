"""Our engine against Hugging Face transformers on the same weights: teacher-forced logits
through the paged prefill, greedy tokens through the step loop, and transformers' own; and
tiny random checkpoints built from transformers' own config classes."""

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.request import SamplingParams


def our_prefill_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the paged prefill path."""
    seq = engine.admit(ids, SamplingParams(max_tokens=1), max_tokens=1)
    engine.add(seq)
    seqs, is_prefill = engine.scheduler.schedule()
    assert is_prefill and seqs == [seq]
    step = engine.runner.prepare(seqs, True)
    step.logits_rows = torch.arange(len(ids))
    logits = engine.runner.run(step)
    seq.finish("abort")  # over: its pages go back
    engine.scheduler.release(seq)
    return logits


def our_greedy(engine: LLMEngine, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    seq = engine.admit(ids, SamplingParams(max_tokens=1, logprobs=0, ignore_eos=True), max_tokens=n)
    engine.add(seq)
    while engine.has_work():
        engine.step()
    return seq.output_ids, [lp.logprob for lp in seq.output_logprobs]


def their_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    # greedy without logits processors: the scores are the raw logits. It stops at eos.
    logprobs = [
        torch.log_softmax(s[0].float(), -1)[t].item()
        for s, t in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


# --- tiny checkpoints from transformers' own config classes ----------------------------------

VOCAB = 256
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    # no eos: transformers generates every token asked for (ours: ignore_eos)
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def redraw(model: torch.nn.Module, seed: int = 1) -> None:
    """Weights whose every part shows: matrices ~ N(0, 1.2^2 / fan_in) (embeddings N(0, 1);
    a MoE's experts, stacked [experts, out, in] in transformers' model, alike), norm gains
    1 + N(0, 0.2^2), biases N(0, 0.2^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:
                p.copy_(1 + 0.2 * noise if "norm" in name else 0.2 * noise)
            else:
                p.copy_(noise * (1.0 if "embed" in name else 1.2 / p.shape[-1] ** 0.5))


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer naming every id (t0 ... t255); eos t1, for the loader."""
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))


def hf_model(folder: Path, config_class: str, **overrides: object) -> torch.nn.Module:
    """A tiny random model from transformers' config class (TINY + overrides), every weight
    redrawn, saved to `folder` as a checkpoint kvfence loads (config.json, model.safetensors,
    tokenizer.json)."""
    import transformers

    config = getattr(transformers, config_class)(**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    redraw(model)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model.eval()


def random_prompt(n: int, seed: int = 2) -> list[int]:
    """Token ids 2 .. VOCAB - 1 (no eos)."""
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
