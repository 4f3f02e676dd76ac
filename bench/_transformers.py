"""Hugging Face transformers `generate` on the SmolLM2 GGUF the engine serves: the baseline of
bench/engine_throughput.py and bench/vs_llamacpp.py.

The file is dequantized to float32 (transformers' best setting on these CPUs: bf16 matmuls are
slow), in this process, one left-padded batch at a time (attention mask passed). Its generation
config gets no EOS id, so `max_new_tokens` alone fixes the length: generation neither stops
nor suppresses EOS, and takes the plain greedy path, as the engine's `ignore_eos` does.
"""

import contextlib
import io
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class Timing:
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


class Transformers:
    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from kvfence_engine.loading.tokenizer_source import smollm2_gguf_path

        hf_logging.set_verbosity_error()
        gguf = smollm2_gguf_path()
        with contextlib.redirect_stderr(io.StringIO()):  # the GGUF loader's progress bars
            self.model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            ).eval()
        self.model.generation_config.eos_token_id = None  # see the module docstring
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """One left-padded batch; returns each prompt's new token ids."""
        new = self.max_tokens
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=new,
            pad_token_id=pad,
        )
        generated = out[:, width:].tolist()
        assert all(len(g) == new for g in generated)
        return generated

    def one_at_a_time(self, prompts: list[list[int]]) -> tuple[Timing, list[list[int]]]:
        start = time.perf_counter()
        outputs = [self.generate([p])[0] for p in prompts]
        return Timing(len(prompts) * self.max_tokens, time.perf_counter() - start), outputs

    def batch(self, prompts: list[list[int]]) -> Timing:
        start = time.perf_counter()
        self.generate(prompts)
        return Timing(len(prompts) * self.max_tokens, time.perf_counter() - start)

    def token_string(self, token_id: int) -> str:
        return self.tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
