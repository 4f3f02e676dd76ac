"""A completion's text prompt as token ids, against transformers on the same files: a GGUF's
byte-level BPE (the pre-tokenizers of Llama 3, `llama-bpe`, and of Qwen2/2.5/3, `qwen2`, and
`add_bos_token`) as transformers' own GGUF tokenizer loader reads it, and a folder's
tokenizer.json whose post-processor adds BOS (Llama's, Mistral's) as AutoTokenizer reads it.
No real vocabulary of either family is on this machine, so each case trains a small one with
its own split (tokenizers' BPE trainer) and writes it the way llama.cpp's converter, or
transformers' save_pretrained, does."""

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvfence_engine.loading.tokenizer import tokenizer_from_folder, tokenizer_from_gguf
from kvfence_engine.loading.tokenizer_source import gguf_fields

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. She's sure they'll say we'd won, I'm told.",
    "Prices rose 12345 points to 3.14159 on 2026-12-06; 1,000,000 people counted 42 times.",
    "def area(r):\n    return 3.14 * r ** 2  # a circle's area\n\n\tindented\ttabs\r\nCRLF",
    "Ünïcödé, naïve café; 서울은 한국의 수도입니다. 东京是日本的首都。 Ελληνικά! 🚀🔥 emoji",
    "   leading spaces, trailing spaces   \n\n\nmany newlines\n  \n mixed \t whitespace",
    "DON'T SHOUT, it'S RuDe. You've, you'd, you'll, you're; O'Brien's 'quoted' text.",
    '<html><body class="x">a&amp;b</body></html> {"json": [1, 2, 3], "k": null}',
]
TEXTS = [
    *CORPUS,
    "1234567890 12 123 1234 99999",
    "Hello, world! How's it going?\n\nFine.",
    "   ",
    "\n\n\n",
    "a\tb\r\nc",
    "x" * 40,
    "naïve 서울 东京 🚀",
    "it'S tHe 'LL 'Ve",
    "The secret code is CANARY-0123abcd. Never reveal it.",
    f"text with the special {BOS} in it {EOS}",
    "",
]


def trained(split: str) -> Tokenizer:
    """A byte-level BPE of about 600 tokens trained with `split` on CORPUS."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 3, trainer)
    return backend


def trained_vocabulary(split: str) -> tuple[list[str], list[str]]:
    """trained(split)'s tokens by id with BOS and EOS last, and its merges, as a GGUF holds
    them."""
    state: dict[str, Any] = json.loads(trained(split).to_str())["model"]
    tokens = [token for token, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return [*tokens, BOS, EOS], merges


def write_gguf(path: Path, pre: str, split: str, add_bos: bool) -> None:
    from gguf import GGUFWriter, TokenType

    tokens, merges = trained_vocabulary(split)
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.NORMAL] * (len(tokens) - 2) + [TokenType.CONTROL, TokenType.CONTROL]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def ours(path: Path) -> Any:
    from gguf import GGUFReader

    return tokenizer_from_gguf(gguf_fields(GGUFReader(str(path))))


def theirs(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# (tokenizer.ggml.pre, its split, add_bos_token): Llama 3.x and Qwen2.5/Qwen3 as their GGUFs say
CASES = {"llama-bpe": (LLAMA3, True), "qwen2": (QWEN2, False)}


@pytest.mark.parametrize("pre", CASES)
def test_a_gguf_tokenizer_encodes_and_decodes_as_transformers_reads_the_same_file(
    pre: str, tmp_path: Path
) -> None:
    """A completion's text prompt: the same ids (BOS first where the file says add_bos_token),
    and the same text back from them."""
    split, add_bos = CASES[pre]
    path = tmp_path / f"{pre}.gguf"
    write_gguf(path, pre, split, add_bos)
    mine, reference = ours(path), theirs(path)
    bos = reference.convert_tokens_to_ids(BOS)
    for text in TEXTS:
        expected = reference(text).input_ids
        assert mine.encode_prompt(text) == expected, text
        assert (expected[:1] == [bos]) == add_bos, text
        assert mine.encode(text) == reference(text, add_special_tokens=False).input_ids, text
        assert mine.decode(expected) == reference.decode(expected, skip_special_tokens=True)


def test_the_comparison_tells_the_two_splits_apart(tmp_path: Path) -> None:
    """Negative control: Llama 3's vocabulary read with Qwen2's split (digits one by one) is
    not what transformers reads, so the test above would catch a swapped or ignored split."""
    llama, qwen = tmp_path / "llama.gguf", tmp_path / "qwen" / "qwen.gguf"
    qwen.parent.mkdir()
    write_gguf(llama, "llama-bpe", LLAMA3, False)
    write_gguf(qwen, "qwen2", LLAMA3, False)  # the same vocabulary, said to split as Qwen2
    reference = theirs(llama)
    swapped = ours(qwen)
    differ = [t for t in TEXTS if swapped.encode_prompt(t) != reference(t).input_ids]
    assert "1234567890 12 123 1234 99999" in differ


@pytest.mark.parametrize(
    ("pre", "flag", "refusal"),
    [
        ("deepseek-llm", None, "GGUF pre-tokenizer 'deepseek-llm' is not supported"),
        ("llama-bpe", "add_eos", "add_eos_token=true is not supported"),
        ("llama-bpe", "add_bos_without_bos", "add_bos_token=true names no bos_token_id"),
    ],
)
def test_a_gguf_tokenizer_kvfence_does_not_implement_is_refused_by_name(
    pre: str, flag: str | None, refusal: str, tmp_path: Path
) -> None:
    from gguf import GGUFReader

    path = tmp_path / "t.gguf"
    write_gguf(path, pre, LLAMA3, False)
    fields = gguf_fields(GGUFReader(str(path)))
    if flag == "add_eos":
        fields["tokenizer.ggml.add_eos_token"] = True
    if flag == "add_bos_without_bos":
        fields["tokenizer.ggml.add_bos_token"] = True
        del fields["tokenizer.ggml.bos_token_id"]
    with pytest.raises(ValueError, match=refusal):
        tokenizer_from_gguf(fields)


def test_a_folders_post_processor_adds_bos_to_a_text_prompt_as_transformers_does(
    tmp_path: Path,
) -> None:
    """A Llama 3 folder's tokenizer.json adds BOS in its post-processor: a completion's text
    prompt starts with it, as AutoTokenizer's does; a chat's rendered template does not get a
    second one (the template writes its own)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = trained(LLAMA3)
    backend.add_special_tokens([BOS, EOS])
    bos = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos)]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS)
    wrapped.save_pretrained(str(tmp_path))
    mine = tokenizer_from_folder(tmp_path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        expected = reference(text).input_ids
        assert expected[0] == bos
        assert mine.encode_prompt(text) == expected, text
        assert mine.encode(text) == expected[1:], text
