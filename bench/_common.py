"""What the benchmarks share: `kvfence serve` subprocesses, the chat prompts, a check that the
machine was not shared, and a percentile.

Prompts are tokenized once, with the transformers tokenizer read from the same GGUF the engine
serves, and sent to the engine as token ids, so every system sees identical tokens.
"""

import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvfence_engine.loading.tokenizer_source import SMOLLM2, smollm2_gguf_path
from kvfence_engine.tools.localproc import LocalProcess

READY_TIMEOUT_S = 120.0

# Varied, realistic requests: short questions, instructions with context, a system prompt,
# a multi-turn exchange. Prompts run from ~30 to ~90 tokens after the chat template.
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Give me three tips for sleeping better."}],
    [{"role": "user", "content": "Explain what a hash table is to a new programmer."}],
    [
        {"role": "system", "content": "You are a concise assistant. Answer in one paragraph."},
        {"role": "user", "content": "Why is the sky blue during the day and red at sunset?"},
    ],
    [{"role": "user", "content": "Write a haiku about autumn leaves falling in a quiet park."}],
    [
        {
            "role": "user",
            "content": "Summarize this: The city council met on Tuesday to discuss the new "
            "bike lanes on Main Street. Shop owners worried about losing parking, while "
            "cyclists said the lanes would make the road safer. The council agreed to run a "
            "six-month trial and count both cyclists and customers before deciding.",
        }
    ],
    [{"role": "user", "content": "How do I convert a Python list of strings to integers?"}],
    [
        {"role": "user", "content": "I want to learn to cook. Where should I start?"},
        {
            "role": "assistant",
            "content": "Start with a few simple dishes you like to eat, such as eggs, pasta "
            "or a stir-fry, and learn basic knife skills.",
        },
        {"role": "user", "content": "What should I buy for my kitchen first?"},
    ],
    [{"role": "user", "content": "What are the main differences between a virus and bacteria?"}],
    [{"role": "user", "content": "Draft a polite email asking my manager for a day off Friday."}],
    [
        {"role": "system", "content": "You are a friendly travel guide."},
        {"role": "user", "content": "Plan a one-day walking tour of Rome for a first visit."},
    ],
    [{"role": "user", "content": "Is it healthier to walk or to run? Explain briefly."}],
    [
        {
            "role": "user",
            "content": "Fix the bug in this code and explain it:\n\n"
            "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
            "    return total / len(xs) + 1\n",
        }
    ],
    [{"role": "user", "content": "Translate 'Good morning, how are you?' into Spanish."}],
    [{"role": "user", "content": "List the planets of the solar system in order from the sun."}],
    [{"role": "user", "content": "What should I consider when adopting a dog from a shelter?"}],
    [{"role": "user", "content": "Tell me a short story about a robot who learns to paint."}],
    [{"role": "user", "content": "How does compound interest work? Use a small example."}],
    [
        {"role": "system", "content": "You answer questions about history."},
        {"role": "user", "content": "Who built the pyramids of Giza, and roughly when?"},
    ],
    [{"role": "user", "content": "Suggest a name for a cozy coffee shop near a university."}],
]


def load_tokenizer() -> Any:
    """The transformers tokenizer of the GGUF the engine serves (with its chat template)."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def chat_prompt_ids(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` prompts (cycling through CONVERSATIONS), chat template applied, as token ids."""
    prompts = []
    for i in range(count):
        text = tokenizer.apply_chat_template(
            CONVERSATIONS[i % len(CONVERSATIONS)], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


class Stoppable(Protocol):
    def stop(self) -> None: ...


@contextlib.contextmanager
def stop_all_on_exit(prefix: str) -> Iterator[tuple[Path, list[Stoppable]]]:
    """A folder for server logs and a list to put each server in as it starts: on exit every
    server in the list is stopped, whatever happens, and the logs are kept only if something
    failed."""
    logs = Path(tempfile.mkdtemp(prefix=prefix))
    started: list[Stoppable] = []
    failed = True
    try:
        yield logs, started
        failed = False
    finally:
        for server in started:
            server.stop()
        if failed:
            print(f"server logs kept in {logs}", file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)


@contextlib.contextmanager
def running_servers(
    specs: Sequence[tuple[str, Sequence[str], dict[str, str]]],
) -> Iterator[dict[str, LocalProcess]]:
    """Start a `kvfence serve` of the builtin SmolLM2 on a free loopback port for each
    (name, extra args, extra env), one after another (loading is CPU-heavy), and stop them all
    on exit, whatever happens. Logs are kept only if something failed."""
    with stop_all_on_exit("kvfence-bench-") as (logs, started):
        servers: dict[str, LocalProcess] = {}
        for name, extra_args, env in specs:
            server = LocalProcess(
                ["serve", "--model", SMOLLM2, *extra_args], env=env, log_path=logs / f"{name}.log"
            )
            started.append(server)
            servers[name] = server.start()
            server.wait_ready(READY_TIMEOUT_S)
        yield servers


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sample."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def _busy_jiffies() -> int:
    """CPU time (clock ticks) the whole machine has spent busy since boot."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal, *_ = map(
            int, f.readline().split()[1:]
        )
    return user + nice + system + irq + softirq + steal


def _process_jiffies(pid: int) -> int:
    """CPU time (clock ticks) of one process, all its threads, and its reaped children."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0
    # fields[0] is field 3 (state): utime, stime, cutime, cstime are fields 14-17.
    return sum(int(x) for x in fields[11:15])


class ForeignCpu:
    """How many cores processes other than ours kept busy over an interval.

    The machine has 2 cores and may be shared: a round that ran next to someone else's test
    suite is left out of the results instead of being reported as if it were clean."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = [os.getpid(), *pids]
        self.start = self._sample()

    def _sample(self) -> tuple[float, int, int]:
        return time.monotonic(), _busy_jiffies(), sum(_process_jiffies(p) for p in self.pids)

    def cores(self) -> float:
        """Average number of cores used by other processes since construction."""
        t0, busy0, ours0 = self.start
        t1, busy1, ours1 = self._sample()
        ticks = os.sysconf("SC_CLK_TCK")
        return max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / ticks / max(t1 - t0, 1e-9))


T = TypeVar("T")

# Other processes' average CPU use above which a round is considered disturbed.
FOREIGN_CORES_LIMIT = 0.1


def undisturbed(rounds: Sequence[T], foreign_cores: Sequence[float]) -> tuple[list[T], str]:
    """The rounds that ran without other load on the machine, and a note on what was left out.
    If every round was disturbed, all are kept and the note says the numbers are skewed."""
    clean = [r for r, c in zip(rounds, foreign_cores, strict=True) if c <= FOREIGN_CORES_LIMIT]
    worst = max(foreign_cores)
    if len(clean) == len(rounds):
        return list(rounds), f"other processes used at most {worst:.2f} cores during any round"
    if not clean:
        return list(rounds), (
            f"every round ran next to other load (up to {worst:.2f} cores): the numbers are "
            "skewed; rerun on a quiet machine"
        )
    return clean, (
        f"{len(rounds) - len(clean)} of {len(rounds)} rounds left out: other processes used "
        f"up to {worst:.2f} cores during them"
    )
