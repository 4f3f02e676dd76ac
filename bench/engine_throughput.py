"""Output tokens/s of the kvfence engine against Hugging Face transformers `generate`.

Every system runs the same SmolLM2-135M-Instruct GGUF, with 2 CPU threads, on the same
token-id prompts (chat template applied), greedy, and produces exactly the same number of
tokens per request. Our engine runs four times, side by side: the file's own Q4_1 blocks as
int4 (`--weight-dtype auto`, the default), the file dequantized to float32 weights, and the
packed weights `--weight-dtype int8` and `--weight-dtype float16` (fewer bytes per step;
activations and the KV pool stay float32); transformers runs the file dequantized to float32.
Their accuracy against float32 is measured in tests/unit/engine/test_int8_weights.py (numbers
in its docstring); here each engine's greedy tokens are compared with transformers' at
concurrency 1. Transformers keeps its best settings here: float32 (bf16 matmuls are slow on
these CPUs), 2 threads, one left-padded batch.

- concurrency 1: N requests sent one at a time to a real `kvfence serve` over HTTP, against
  transformers generating the same N prompts one at a time (batch 1);
- concurrency 16: 16 requests in flight at once against one left-padded transformers batch of
  the same 16 prompts (attention mask passed).

Our numbers include HTTP, JSON and scheduling; transformers' are a bare in-process call. The
targets are what continuous batching over a paged pool should buy: at least parity at
concurrency 1 and >= 1.3x at concurrency 16.

Same output length without changing the greedy path: our `ignore_eos` keeps generating (EOS
included) past an end of turn, while transformers' `min_new_tokens` would instead forbid EOS
and pick another token. Transformers' generation config therefore gets no EOS id, and
`max_new_tokens` alone fixes the length: it neither stops nor suppresses, so both systems take
the same greedy path and the token-for-token
comparison at concurrency 1 is meaningful (float32 differences can still flip rare near-ties,
so mismatches are reported, not asserted).

No two systems run at the same time (2 cores): the transformers model lives in this process
and is idle while an engine serves, the engines are idle while transformers generates. Rounds
interleave the systems (each engine, then transformers, per scenario) and the median is
reported.
The machine may be shared: a round during which other processes used CPU is left out (see
_common.undisturbed), and the output says so.
"""

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import torch

from _common import (
    ForeignCpu,
    chat_prompt_ids,
    load_tokenizer,
    running_servers,
    undisturbed,
)
from _transformers import Timing, Transformers

THREADS = 2
CONCURRENCY = 16
TARGETS = {1: 1.0, CONCURRENCY: 1.3}
# our engines: name -> extra `kvfence serve` arguments
ENGINES = {
    "int4": [],  # --weight-dtype auto, the default: the file's own Q4_1 blocks
    "float32": ["--weight-dtype", "float32"],
    "int8": ["--weight-dtype", "int8"],
    "float16": ["--weight-dtype", "float16"],
}
THEIRS = "transformers"


Round = dict[tuple[str, int], float]  # (system, concurrency) -> output tokens/s
T = TypeVar("T")


# --- ours: the engine over HTTP -------------------------------------------------------------


async def send_all(
    prompts: list[list[int]], send: Callable[[list[int]], Awaitable[T]], concurrency: int
) -> tuple[float, list[T]]:
    """Every prompt through `send`, at most `concurrency` in flight (1: one after another, in
    order); the wall time of all of them and their results, in prompt order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> T:
        async with gate:
            return await send(prompt)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - start, list(results)


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed completion as its client saw it."""

    first_token_s: float | None  # from sending to the first token's event; None: none came
    seconds: float  # from sending to the end of the stream
    completion_tokens: int  # as the closing usage event says (0 without one)
    error_code: str | None  # the code of an error answer, or of the error event that ended it

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The tokens after the first over the time after the first (None: too few)."""
        if self.first_token_s is None or self.completion_tokens < 2:
            return None
        after_first = self.seconds - self.first_token_s
        return (self.completion_tokens - 1) / after_first if after_first > 0 else None


def error_code(response: httpx.Response) -> str:
    """The `code` of an OpenAI-shaped error body (or what the answer was instead)."""
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"


class EngineClient:
    def __init__(self, client: httpx.AsyncClient, base_url: str, max_tokens: int) -> None:
        self.client = client
        self.url = f"{base_url}/v1/completions"
        self.max_tokens = max_tokens

    def body(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        """A greedy completion of exactly max_tokens tokens (ignore_eos)."""
        return {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }

    async def complete(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        response = await self.client.post(self.url, json=self.body(prompt, **extra))
        response.raise_for_status()
        result = response.json()
        got = result["usage"]["completion_tokens"]
        assert got == self.max_tokens, f"asked for {self.max_tokens} tokens, got {got}"
        return result

    async def stream(self, prompt: list[int], **extra: Any) -> Streamed:
        """The same request streamed (server-sent events, usage at the end): when its first
        token arrived, and how it ended. An error is returned, not raised."""
        body = self.body(prompt, stream=True, stream_options={"include_usage": True}, **extra)
        start = time.perf_counter()
        first, tokens, error = None, 0, None
        async with self.client.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Streamed(None, time.perf_counter() - start, 0, error_code(response))
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    error = str(event["error"].get("code"))
                    break
                if event.get("choices") and first is None:
                    first = time.perf_counter() - start
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
        return Streamed(first, time.perf_counter() - start, tokens, error)

    async def one_at_a_time(self, prompts: list[list[int]]) -> Timing:
        seconds, _ = await send_all(prompts, self.complete, 1)
        return Timing(len(prompts) * self.max_tokens, seconds)

    async def all_at_once(self, prompts: list[list[int]]) -> Timing:
        seconds, _ = await send_all(prompts, self.complete, len(prompts))
        return Timing(len(prompts) * self.max_tokens, seconds)

    async def token_strings(self, prompt: list[int]) -> list[str]:
        """The generated tokens as the API names them (logprobs carry one string per token)."""
        result = await self.complete(prompt, logprobs=0)
        return list(result["choices"][0]["logprobs"]["tokens"])


# --- the run --------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 round, 4 sequential prompts (~1.5 min)"
    )
    parser.add_argument("--rounds", type=int, help="interleaved repetitions (default 3)")
    parser.add_argument(
        "--sequential-prompts", type=int, help="N for the concurrency-1 scenario (default 8)"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"which of our engines to run, comma-separated (default {','.join(ENGINES)})",
    )
    args = parser.parse_args()
    args.engines = args.engines.split(",")
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"--engines: unknown {sorted(unknown)}; choose from {list(ENGINES)}")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.sequential_prompts = args.sequential_prompts or (4 if args.quick else 8)
    return args


async def warm_up(
    ours: dict[str, EngineClient], theirs: Transformers, prompts: list[list[int]]
) -> None:
    """One untimed pass of each measured shape, at full length: first calls pay for lazy
    allocation (the KV pool is touched page by page), allocator growth and kernel selection."""
    for engine in ours.values():
        await engine.one_at_a_time(prompts[:1])
        await engine.all_at_once(prompts)
    theirs.one_at_a_time(prompts[:1])
    theirs.batch(prompts)


def agreement(ours: list[list[str]], theirs: list[list[str]]) -> tuple[int, list[str]]:
    same, notes = 0, []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            same += 1
            continue
        at = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        notes.append(
            f"prompt {i}: first difference at token {at}: ours {a[at]!r}, theirs {b[at]!r}"
        )
    return same, notes


def report(rounds: list[Round], foreign_cores: list[float], engines: list[str]) -> None:
    kept, note = undisturbed(rounds, foreign_cores)
    print()
    print(f"{'scenario':<16}{'system':<16}{'tok/s':>9}{'vs transformers':>17}  target")
    for concurrency, target in TARGETS.items():
        theirs = statistics.median(r[(THEIRS, concurrency)] for r in kept)
        scenario = f"concurrency {concurrency}"
        print(f"{scenario:<16}{THEIRS:<16}{theirs:>9.1f}")
        for name in engines:
            ours = statistics.median(r[(name, concurrency)] for r in kept)
            ratio = ours / theirs
            verdict = "met" if ratio >= target else "NOT MET"
            system = "ours " + name
            print(f"{'':<16}{system:<16}{ours:>9.1f}{ratio:>16.3f}x  >={target:.1f}x {verdict}")
    print(f"(median over {len(kept)} of {len(rounds)} rounds; {note})")
    print()
    print("per round (tokens/s; ratios pair a system with transformers within a round):")
    for concurrency in TARGETS:
        theirs = [r[(THEIRS, concurrency)] for r in rounds]
        lines: list[tuple[str, list[float]]] = [(THEIRS, theirs)]
        for name in engines:
            ours = [r[(name, concurrency)] for r in rounds]
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            lines += [(name, ours), (name + " ratio", ratios)]
        for label, row in lines:
            fmt = "6.2f" if label.endswith("ratio") else "6.1f"
            cells = "  ".join(f"{x:{fmt}}" for x in row)
            print(f"  concurrency {concurrency:<3} {label:<19} {cells}")
    cells = "  ".join(f"{c:6.2f}" for c in foreign_cores)
    print(f"  other processes (cores)             {cells}")


async def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(THREADS)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer()
    prompts = chat_prompt_ids(tokenizer, max(CONCURRENCY, args.sequential_prompts))
    sequential = prompts[: args.sequential_prompts]
    concurrent = prompts[:CONCURRENCY]
    theirs = Transformers(tokenizer, args.max_tokens)
    limits = httpx.Limits(max_connections=2 * CONCURRENCY)
    specs = [(name, ["--threads", str(THREADS), *ENGINES[name]], {}) for name in args.engines]
    with running_servers(specs) as servers:
        pids = [server.proc.pid for server in servers.values() if server.proc is not None]
        async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
            ours = {
                name: EngineClient(client, servers[name].url, args.max_tokens)
                for name in args.engines
            }
            setup = time.perf_counter() - t0
            print(f"setup (tokenizer, transformers model, engine servers): {setup:.0f}s")
            lengths = [len(p) for p in concurrent]
            print(
                f"{args.sequential_prompts} sequential prompts, {CONCURRENCY} concurrent prompts "
                f"({min(lengths)}-{max(lengths)} prompt tokens), {args.max_tokens} new tokens "
                f"each, greedy, {THREADS} threads, {args.rounds} round(s), median reported; "
                f"our engines: {', '.join(args.engines)}"
            )
            await warm_up(ours, theirs, concurrent)
            rounds: list[Round] = []
            foreign_cores: list[float] = []
            their_sequential_ids: list[list[int]] = []
            for round_no in range(args.rounds):
                t = time.perf_counter()
                foreign = ForeignCpu(pids)
                result: Round = {}
                for name, engine in ours.items():
                    result[(name, 1)] = (await engine.one_at_a_time(sequential)).tokens_per_s
                theirs_1, their_sequential_ids = theirs.one_at_a_time(sequential)
                result[(THEIRS, 1)] = theirs_1.tokens_per_s
                for name, engine in ours.items():
                    timing = await engine.all_at_once(concurrent)
                    result[(name, CONCURRENCY)] = timing.tokens_per_s
                result[(THEIRS, CONCURRENCY)] = theirs.batch(concurrent).tokens_per_s
                rounds.append(result)
                foreign_cores.append(foreign.cores())
                print(f"round {round_no + 1}/{args.rounds}: {time.perf_counter() - t:.0f}s")
            our_tokens = {
                name: [await engine.token_strings(p) for p in sequential]
                for name, engine in ours.items()
            }
    their_tokens = [[theirs.token_string(t) for t in ids] for ids in their_sequential_ids]
    report(rounds, foreign_cores, args.engines)
    print()
    print(
        f"greedy agreement with transformers at concurrency 1 ({args.max_tokens} tokens, "
        "compared token by token, as token strings):"
    )
    for name, tokens in our_tokens.items():
        same, notes = agreement(tokens, their_tokens)
        print(f"  ours {name}: {same}/{len(sequential)} prompts identical")
        for note in notes:
            print(f"    {note}")
    print(
        "packed weights' accuracy against float32 (logits over ~1000 positions, greedy "
        "agreement on these prompts): tests/unit/engine/test_int8_weights.py"
    )
    print(f"total time: {time.perf_counter() - t0:.0f}s")


def main() -> None:
    asyncio.run(run(parse_args()))


if __name__ == "__main__":
    main()
