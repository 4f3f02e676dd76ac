"""Tensor parallelism on CPU: the same model at TP=1 and TP=2, in one run, on this machine.

TP=1 is one engine with every thread (--threads, default the machine's cores); TP=2 is rank 0
in this process and rank 1 a process of its own (gloo over loopback), each with half of them:
the same cores, split. Each scenario submits `concurrency` requests of the same 64-token
prompt and steps the engine (no HTTP) until each has generated --tokens greedy tokens
(ignore_eos); rounds alternate TP=1 and TP=2 and the median is reported.

Printed per concurrency: output tokens/s of each and their ratio, the greedy tokens' agreement
(TP=2 against TP=1, the first request), and the collectives' share of rank 0's step time at
TP=2 (its all-reduces after attention and the MLP, the embedding's, and the logits' gather,
each including its wait for the other rank to get there).
The last line is the summary with the CPU's capability (AVX2, AVX512: figures from different
CPUs do not compare).

TP on CPU is for testing the path the GPUs run, and for models a process cannot hold: on one
machine's cores it adds two all-reduces per layer to every step, and is not expected to be
faster.

    python bench/tensor_parallel.py [--model builtin:smollm2-135m-instruct] [--rounds 3]
"""

import argparse
import os
import statistics
import time

import torch

from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.request import SamplingParams
from kvfence_engine.loading.loader import load_model
from kvfence_engine.parallel.launch import start_ranks
from kvfence_engine.tools.localproc import free_port


def run(engine: LLMEngine, concurrency: int, tokens: int) -> tuple[float, list[int]]:
    """Output tokens/s of `concurrency` greedy requests, and the first one's tokens."""
    ids = list(range(100, 164))  # 64 tokens
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    seqs = [engine.admit(ids, params, max_tokens=tokens) for _ in range(concurrency)]
    started = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - started
    return concurrency * tokens / elapsed, seqs[0].output_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--weight-dtype", default=None, help="default: the engine's auto")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = parser.parse_args()
    args = EngineArgs(kv_cache_memory=256 << 20, weight_dtype=a.weight_dtype, max_num_seqs=64)
    cpu = torch.backends.cpu.get_cpu_capability()

    torch.set_num_threads(a.threads)
    one = LLMEngine(load_model(a.model), args)
    half = max(1, a.threads // 2)
    ranks = start_ranks(2, a.model, args, free_port(), threads=half)
    torch.set_num_threads(half)
    group = ranks.join_as_rank0("cpu")
    two = LLMEngine(load_model(a.model), args, group=group)
    assert two.leader is not None
    print(
        f"model={a.model} weights={one.precision.weights} cpu={cpu} threads={a.threads} "
        f"(TP=2: {half} per rank) tokens={a.tokens} rounds={a.rounds}"
    )
    summary = []
    try:
        for concurrency in a.concurrency:
            speeds: dict[int, list[float]] = {1: [], 2: []}
            first: dict[int, list[int]] = {}
            shares = []
            for _ in range(a.rounds):
                torch.set_num_threads(a.threads)
                speed, first[1] = run(one, concurrency, a.tokens)
                speeds[1].append(speed)
                torch.set_num_threads(half)
                collectives, steps = group.collective_seconds, two.metrics.step_seconds._value.get()
                speed, first[2] = run(two, concurrency, a.tokens)
                speeds[2].append(speed)
                step_time = two.metrics.step_seconds._value.get() - steps
                shares.append((group.collective_seconds - collectives) / step_time)
            tp1, tp2 = statistics.median(speeds[1]), statistics.median(speeds[2])
            agree = sum(x == y for x, y in zip(first[1], first[2], strict=True))
            share = statistics.median(shares)
            print(
                f"concurrency {concurrency}: TP=1 {tp1:.1f} tokens/s, TP=2 {tp2:.1f} tokens/s "
                f"({tp2 / tp1:.2f}x); greedy tokens agree {agree}/{a.tokens}; collectives "
                f"{share:.0%} of rank 0's step time"
            )
            summary.append(f"c{concurrency}: {tp2 / tp1:.2f}x, collectives {share:.0%}")
    finally:
        ranks.stop(two.leader.stop)
        group.close()
    print(
        f"tensor_parallel cpu={cpu} weights={one.precision.weights}: TP=2/TP=1 "
        + "; ".join(summary)
    )


if __name__ == "__main__":
    main()
