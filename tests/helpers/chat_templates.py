"""Tokenizers with chat templates to test chat prompts with: SmolLM2's own (ChatML), and a
Llama 3-style one, written as a tokenizer folder and read by the real loader."""

import json
from pathlib import Path

from kvfence_engine.loading.tokenizer import Tokenizer
from kvfence_engine.loading.tokenizer_source import load_tokenizer, smollm2_tokenizer

CHATML_CONTROLS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
LLAMA3_CONTROLS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# Meta's Llama 3 Instruct template: it trims each message's content
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def write_llama3_style_tokenizer(folder: Path) -> Path:
    """SmolLM2's byte-level BPE with Llama 3's special tokens and chat template, as a
    tokenizer.json + tokenizer_config.json folder."""
    data = json.loads(smollm2_tokenizer().backend.to_str())
    next_id = len(data["model"]["vocab"])  # SmolLM2's own special tokens are in it
    for offset, content in enumerate(LLAMA3_CONTROLS):
        data["added_tokens"].append(
            {"id": next_id + offset, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    config = {"bos_token": LLAMA3_CONTROLS[0], "eos_token": "<|eot_id|>"}
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config | {"chat_template": LLAMA3_TEMPLATE})
    )
    return folder


def llama3_style_tokenizer(folder: Path) -> Tokenizer:
    return load_tokenizer(str(write_llama3_style_tokenizer(folder)))[1]
