"""Prefill time of long prompts: kvfence's engine and transformers on the same SmolLM2 weights,
in one run, in this process (no HTTP on either side).

- kvfence: the combined engine on `builtin:smollm2-135m-instruct` in float32 (the weights
  dequantized from the GGUF, as transformers runs them), one prompt per step
  (--max-batched-tokens at least the longest prompt), one new token;
- transformers: a forward pass of the same prompt through the same GGUF dequantized to float32
  (bench/_transformers.py), its default attention (sdpa).

Each length runs `--rounds` times interleaved; the fastest of each is kept (the machine is
noisy, and prefill is pure compute). Prompts are random token ids. The CPU's ISA (AVX2 or
AVX-512) is printed with the figures.

    python bench/prefill.py --lengths 512 2048 4000
"""

import argparse
import random
import time

import torch

from _transformers import Transformers
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.request import SamplingParams, is_terminal
from kvfence_engine.loading.loader import load_model
from kvfence_engine.loading.tokenizer_source import SMOLLM2


def kvfence_prefill(engine: LLMEngine, ids: list[int]) -> float:
    seq = engine.admit(ids, SamplingParams(max_tokens=1), max_tokens=1)
    engine.add(seq)
    start = time.perf_counter()
    while not is_terminal(seq):
        engine.step()
    return time.perf_counter() - start


@torch.inference_mode()
def transformers_prefill(model: torch.nn.Module, ids: list[int]) -> float:
    start = time.perf_counter()
    model(torch.tensor([ids]))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    longest = max(args.lengths)
    args_ = EngineArgs(
        kv_cache_memory=256 << 20,
        context_length=longest + 16,
        max_batched_tokens=longest + 16,
        weight_dtype="float32",
    )
    engine = LLMEngine(load_model(SMOLLM2), args_)
    theirs = Transformers(tokenizer=None, max_tokens=1).model
    rng = random.Random(0)
    prompts = {n: [rng.randrange(100, 40000) for _ in range(n)] for n in args.lengths}
    kvfence_prefill(engine, prompts[args.lengths[0]][:64])  # warm both up
    transformers_prefill(theirs, prompts[args.lengths[0]][:64])
    ours: dict[int, float] = {}
    hf: dict[int, float] = {}
    for _ in range(args.rounds):
        for n, ids in prompts.items():
            ours[n] = min(ours.get(n, float("inf")), kvfence_prefill(engine, ids))
            hf[n] = min(hf.get(n, float("inf")), transformers_prefill(theirs, ids))
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"prefill, SmolLM2-135M float32, {args.threads} threads, CPU {isa}, "
          f"best of {args.rounds}")  # fmt: skip
    print("| prompt tokens | transformers s | kvfence s | kvfence / transformers |")
    print("|---|---|---|---|")
    for n in args.lengths:
        print(f"| {n} | {hf[n]:.3f} | {ours[n]:.3f} | {hf[n] / ours[n]:.2f}x |")


if __name__ == "__main__":
    main()
