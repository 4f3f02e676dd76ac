"""What streaming an answer's text costs per token, as the answer grows (issue 33, finding 4).

The router and the engines turn every token of every answer into text on their event loop
(`kvfence_engine/loading/detokenizer.py::Detokenizer`, one token a push, as a stream delivers
them, with a stop string that never matches so that stop handling is part of the cost). The
answer is SmolLM2's tokenization of this repository's docs with text in many scripts and emoji
mixed in, cut to each length. For each length: the CPU time per token of the detokenizer (this
process's CPU time, best of --repeats), and of decoding the whole answer again for every token,
which is what the detokenizer did before (the baseline). The last line:

    cpu=AVX512 us_per_token_500=.. us_per_token_4000=.. ratio=..x whole_redecode_ratio=..x

where ratio is the per-token cost at 4,000 tokens over that at 500 (linear detokenization: about
1x). About 20 s on 2 cores, the baseline at 8,000 tokens most of it.

    python bench/detokenize.py
    python bench/detokenize.py --lengths 500 4000 16000 --repeats 5
"""

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvfence_engine.loading.detokenizer import Detokenizer
from kvfence_engine.loading.tokenizer import Tokenizer
from kvfence_engine.loading.tokenizer_source import smollm2_tokenizer

DOCS = Path(__file__).resolve().parents[1] / "docs"
MIXED = "中文字符测试 😀🎉👍🏽 héllo wörld ñ Ελληνικά русский العربية ✓\n"


def answer_ids(tokenizer: Tokenizer, tokens: int) -> list[int]:
    paragraphs = [p for doc in sorted(DOCS.glob("*.md")) for p in doc.read_text().split("\n\n")]
    text = MIXED.join(paragraphs)
    while len(ids := tokenizer.encode(text)) < tokens:
        text += text
    return ids[:tokens]


def streamed(tokenizer: Tokenizer, ids: list[int]) -> None:
    detok = Detokenizer(tokenizer, ("a stop string this text never holds",))
    for token in ids:
        detok.push([token])
    detok.push([], final=True)


def whole_redecode(tokenizer: Tokenizer, ids: list[int]) -> None:
    for end in range(1, len(ids) + 1):
        tokenizer.decode(ids[:end])


def cpu_per_token(
    work: Callable[[Tokenizer, list[int]], None], tokenizer: Tokenizer, ids: list[int], repeats: int
) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        work(tokenizer, ids)
        best = min(best, time.process_time() - start)
    return best / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 4000, 8000])
    parser.add_argument("--repeats", type=int, default=3, help="runs per length; the best counts")
    args = parser.parse_args()
    lengths = sorted({500, 4000, *args.lengths})
    tokenizer = smollm2_tokenizer()
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"SmolLM2's tokenizer, one token a push; CPU {cpu}; best of {args.repeats} runs")
    print(f"{'answer tokens':>14} {'detokenizer us/token':>21} {'whole re-decode us/token':>25}")
    ours, whole = {}, {}
    for length in lengths:
        ids = answer_ids(tokenizer, length)
        ours[length] = cpu_per_token(streamed, tokenizer, ids, args.repeats) * 1e6
        whole[length] = cpu_per_token(whole_redecode, tokenizer, ids, 1) * 1e6
        print(f"{length:>14} {ours[length]:>21.1f} {whole[length]:>25.1f}")
    print(
        f"cpu={cpu} us_per_token_500={ours[500]:.1f} "
        f"us_per_token_4000={ours[4000]:.1f} ratio={ours[4000] / ours[500]:.2f}x "
        f"whole_redecode_ratio={whole[4000] / whole[500]:.2f}x"
    )


if __name__ == "__main__":
    main()
