"""The prefix cache on multi-turn chat: time to first token with and without it, and proof that
no tenant ever hits another tenant's pages (issue 17).

Two disaggregated deployments of real processes on loopback, started side by side in one run:
`kvfence router` + `kvfence serve --role prefill` (--prefills of them) + `--role decode`, one
without the cache and one with `--prefix-cache` on its prefill engines and `--routing-secret-file`
on its router (prefix-aware routing within a tenant). Each gets the same workload:

  conversations  --tenants tenants at once (default 8), each with its own API key and its own
                 --system-tokens system prompt (default 512 tokens), --turns turns (default 4)
                 one after another: turn k sends the system prompt, the k-1 earlier exchanges
                 (scripted answers, so both deployments see identical prompts) and a new
                 question. Streamed through the `openai` client; time to first token is the
                 time to the first chunk.
  cross-tenant   then, for each tenant, two probe tenants that have sent nothing before send,
                 word for word, the first and the last prompt that tenant sent. The sum of their
                 usage.prompt_tokens_details.cached_tokens is cross_tenant_hits, which must be 0
                 (a probe with no history of its own: a chatting tenant may rightly hit its own
                 pages of the text every prompt begins with, the chat template's and the
                 system prompt's first words).

Reported per deployment: TTFT p50 of first turns and of turns 2.. (the ones a cache can serve),
requests/s and prompt tokens/s over the conversations, the cached tokens reported to the
tenants themselves, and the cross-tenant hits. Whether the cache is on is read from each prefill
engine's /v1/kvpool (`prefix_cache`), never assumed: an engine that reports it off (a decode
role, which computes no prompt, ignores the flag) is said so, and the speedup is then ~1x.
The last line:

    ttft_p50_cold_ms=.. ttft_p50_cached_ms=.. speedup=..x cross_tenant_hits=0 prefix_cache=on

where cold and cached are turns 2.. without and with the cache. --rounds (default 2) repeats
the workload with new system prompts, alternating which deployment goes first; each
deployment's first request is an unmeasured warm-up. Exit status 1 if any request
failed or cross_tenant_hits > 0.

    python bench/prefix_cache.py                          # SmolLM2-135M, a few minutes on 2 cores
    python bench/prefix_cache.py --model builtin:tiny-random --tenants 2 --turns 2
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from _common import ForeignCpu, Stoppable, percentile, stop_all_on_exit
from kvfence_engine.loading.tokenizer import Tokenizer
from kvfence_engine.loading.tokenizer_source import SMOLLM2, load_tokenizer
from kvfence_engine.tools.localproc import LocalProcess, ProcessFailed, last_line

READY_TIMEOUT_S = 300.0
VOCABULARY = (
    "policy customer order invoice shipping refund warranty account support ticket "
    "billing contract delivery supplier inventory schedule meeting report budget forecast "
    "review quality safety training onboarding security privacy compliance audit release "
    "roadmap feature request incident outage escalation partner region market pricing "
    "discount"
)
WORDS = VOCABULARY.split()
QUESTIONS = (
    "Summarize the most important rule above in one sentence.",
    "Give one example of a case where that rule applies.",
    "What should I do if the customer disagrees?",
    "List two things to check before closing the ticket.",
    "How would you explain this to a new colleague?",
    "Anything else I should keep in mind today?",
)


def system_prompt(tokenizer: Tokenizer, tenant: int, tokens: int, round_: int = 0) -> str:
    """About `tokens` tokens of instructions, different for every tenant and round (a round
    must not hit the pages of the one before)."""
    rng = random.Random(f"tenant-{tenant}-round-{round_}")
    text = f"You are the support assistant of company {tenant}-{round_}. Follow these rules. "
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(12)) + ". "
    return tokenizer.decode(tokenizer.encode(text)[:tokens])


def conversation(system: str, turns: int) -> list[list[dict[str, str]]]:
    """The messages of each turn: the system prompt, the earlier exchanges, a new question."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    out = []
    for k in range(turns):
        question = QUESTIONS[k % len(QUESTIONS)]
        out.append([*history, {"role": "user", "content": question}])
        history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"Noted; here is my short answer to point {k + 1}."},
        ]
    return out


@dataclass
class Answer:
    tenant: int
    turn: int  # 0-based; -1 for a cross-tenant probe
    ttft_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Deployment:
    name: str
    router: LocalProcess
    prefills: list[LocalProcess]
    cache_note: str = ""
    answers: list[Answer] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    processes: list[LocalProcess] = field(default_factory=list)  # for ForeignCpu

    def cache_on(self) -> bool:
        """What the prefill engines say, not what was asked for."""
        return all(
            bool(httpx.get(p.url + "/v1/kvpool", timeout=60).json().get("prefix_cache"))
            for p in self.prefills
        )


def start(
    name: str,
    args: argparse.Namespace,
    logs: Path,
    keys: Path,
    started: list[Stoppable],
    cache: bool,
) -> Deployment:
    engine = ["--model", args.model, "--context-length", str(args.context_length)]
    engine += ["--kv-cache-memory", args.kv_cache_memory, "--transfer-port", "0"]
    engine += ["--threads", str(args.threads)]

    def serve(role: str, i: int, extra: Sequence[str] = (), log: str = "") -> LocalProcess:
        proc = LocalProcess(
            ["serve", "--role", role, *engine, *extra],
            log_path=logs / f"{name}-{role}{i}{log}.log",
        )
        started.append(proc)
        return proc.start()

    note = ""
    prefills = []
    for i in range(args.prefills):
        partition = ["--prefix-cache-share", str(args.prefix_cache_share)]
        partition += ["--prefix-cache-tenants", str(args.tenants)]  # a slot per chatting tenant
        proc = serve("prefill", i, ["--prefix-cache", *partition] if cache else [])
        try:
            proc.wait_ready(READY_TIMEOUT_S)
        except ProcessFailed:
            if not cache:
                raise
            note = last_line(proc.log_path)
            # the same process without the cache, said so below (the refusal's log kept)
            proc = serve("prefill", i, log="-without-cache")
            proc.wait_ready(READY_TIMEOUT_S)
        prefills.append(proc)
    decode = serve("decode", 0).wait_ready(READY_TIMEOUT_S)
    router_args = ["router", "--model", args.model, "--api-keys", str(keys)]
    for p in prefills:
        router_args += ["--prefill", p.url]
    router_args += ["--decode", decode.url]
    if cache:
        secret = logs / "routing-secret"
        secret.write_text(random.randbytes(32).hex())
        router_args += ["--routing-secret-file", str(secret)]
    router = LocalProcess(router_args, log_path=logs / f"{name}-router.log")
    started.append(router)
    router.start().wait_ready(READY_TIMEOUT_S)
    return Deployment(name, router, prefills, note, processes=[*prefills, decode, router])


def ask(
    client: openai.OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, openai.types.CompletionUsage]:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft, usage = None, None
    for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    if ttft is None or usage is None:
        raise RuntimeError("the stream ended without a chunk or without usage")
    return ttft, usage


def cached_of(usage: openai.types.CompletionUsage) -> int:
    details = usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def run_workload(
    d: Deployment,
    keys: list[str],
    probe_keys: list[str],
    turns: list[list[list[dict[str, str]]]],
    max_tokens: int,
) -> None:
    """`keys`: the tenants that chat; `probe_keys`: two per chatting tenant, tenants that have
    sent nothing before, so every cached token one is told of is a cross-tenant hit (a tenant
    that chatted may rightly hit its own pages of the text all prompts begin with)."""

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=d.router.url + "/v1", api_key=key, max_retries=0, timeout=600)

    clients = [client(k) for k in keys]
    probes = [client(k) for k in probe_keys]
    model = clients[0].models.list().data[0].id
    if not d.answers and not d.failures:  # warm-up: a fresh process's first request pays
        try:  # one-time costs
            ask(clients[0], model, [{"role": "user", "content": "Hello!"}], max_tokens)
        except (openai.OpenAIError, RuntimeError) as exc:
            d.failures.append(f"warm-up: {exc}")

    def one(tenant: int, turn: int, messages: list[dict[str, str]]) -> None:
        try:
            ttft, usage = ask(
                (clients if turn >= 0 else probes)[tenant], model, messages, max_tokens
            )
        except (openai.OpenAIError, RuntimeError) as exc:
            d.failures.append(f"tenant {tenant} turn {turn}: {exc}")
            return
        d.answers.append(
            Answer(
                tenant,
                turn,
                ttft,
                usage.prompt_tokens,
                usage.completion_tokens,
                cached_of(usage),
            )
        )

    def chat(tenant: int) -> None:
        for turn, messages in enumerate(turns[tenant]):
            one(tenant, turn, messages)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(keys)) as pool:
        list(pool.map(chat, range(len(keys))))
    d.seconds += time.perf_counter() - t0
    # Cross-tenant: a tenant's first and last prompts, word for word, each from a probe tenant
    # of its own (the last begins with the first: one probe sending both would hit its own).
    for tenant in range(len(keys)):
        for j, messages in enumerate((turns[tenant][0], turns[tenant][-1])):
            one(2 * tenant + j, -1, messages)


def ms(values: list[float]) -> float:
    return 1000 * statistics.median(values) if values else float("nan")


def summary(d: Deployment) -> dict[str, float]:
    talks = [a for a in d.answers if a.turn >= 0]
    return {
        "first": ms([a.ttft_s for a in talks if a.turn == 0]),
        "later": ms([a.ttft_s for a in talks if a.turn > 0]),
        "later_p90": 1000 * percentile([a.ttft_s for a in talks if a.turn > 0] or [0.0], 90),
        "req_s": len(talks) / d.seconds if d.seconds else 0.0,
        "prompt_tok_s": sum(a.prompt_tokens for a in talks) / d.seconds if d.seconds else 0.0,
        "prompt_tokens": statistics.mean([a.prompt_tokens for a in talks] or [0]),
        "own_hits": sum(a.cached_tokens for a in talks),
        "cross": sum(a.cached_tokens for a in d.answers if a.turn < 0),
        "cross_ms": ms([a.ttft_s for a in d.answers if a.turn < 0]),
    }


@contextmanager
def deployments(args: argparse.Namespace, keys: Path) -> Iterator[tuple[Deployment, Deployment]]:
    """Both deployments, stopped on exit whatever happens (logs kept if something failed)."""
    with stop_all_on_exit("kvfence-prefix-bench-") as (logs, started):
        cold = start("nocache", args, logs, keys, started, cache=False)
        warm = start("cache", args, logs, keys, started, cache=True)
        yield cold, warm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=8, help="answer tokens per request")
    p.add_argument("--prefills", type=int, default=1, help="prefill engines per deployment")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="512Mi", help="KV pool per engine")
    p.add_argument(
        "--prefix-cache-share",
        type=float,
        default=0.5,
        help="the cache's partition of the cached deployment's prefill pools (SmolLM2, 512Mi: "
        "half is 45 pages a tenant, a whole 4-turn chat)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="workload rounds, new system prompts each, the two deployments' order alternating",
    )
    args = p.parse_args()
    if args.tenants < 2 or args.turns < 2 or args.rounds < 1:
        print("prefix_cache: need at least 2 tenants, 2 turns and 1 round", file=sys.stderr)
        return 2

    _, tokenizer = load_tokenizer(args.model)
    api_keys = [f"sk-prefix-bench-{t:02d}-{random.getrandbits(64):x}" for t in range(args.tenants)]
    # fresh probe tenants, two per chatting tenant and round: they have no pages of their own
    probe_keys = [
        [f"sk-prefix-probe-{r}-{t:02d}-{random.getrandbits(64):x}" for t in range(2 * args.tenants)]
        for r in range(args.rounds)
    ]
    with tempfile.TemporaryDirectory(prefix="kvfence-prefix-bench-keys-") as here:
        keys_file = Path(here) / "keys"
        keys_file.write_text(
            "".join(f"{k} tenant-{t}\n" for t, k in enumerate(api_keys))
            + "".join(
                f"{k} probe-{r}-{t}\n"
                for r, keys in enumerate(probe_keys)
                for t, k in enumerate(keys)
            )
        )
        with deployments(args, keys_file) as (cold, warm):
            foreign = ForeignCpu([p.proc.pid for p in warm.processes + cold.processes if p.proc])
            for r in range(args.rounds):
                turns = [
                    conversation(system_prompt(tokenizer, t, args.system_tokens, r), args.turns)
                    for t in range(args.tenants)
                ]
                for d in (cold, warm) if r % 2 == 0 else (warm, cold):  # no order advantage
                    run_workload(d, api_keys, probe_keys[r], turns, args.max_tokens)
            cache_on = warm.cache_on()
            assert not cold.cache_on(), "the deployment without the cache has one"
            busy = foreign.cores()

    a, b = summary(cold), summary(warm)
    print(
        f"{args.rounds} rounds of {args.tenants} tenants x {args.turns} turns, system prompts "
        f"of {args.system_tokens} "
        f"tokens, {args.max_tokens} answer tokens, model {args.model}, {args.prefills} "
        f"prefill + 1 decode per deployment; mean prompt {a['prompt_tokens']:.0f} tokens"
    )
    print(f"other processes used {busy:.2f} cores on average during the run")
    if cache_on:
        print("prefix cache: on in every prefill engine of the cache deployment")
    else:
        why = f" ({warm.cache_note})" if warm.cache_note else ""
        print(
            f"prefix cache: OFF{why}: the 'cache' deployment runs without it, so a speedup "
            "near 1x is the honest result"
        )
    print(f"{'':28}{'no cache':>12}{'cache':>12}")
    rows = [
        ("TTFT p50, first turns (ms)", "first", "{:.0f}"),
        ("TTFT p50, turns 2.. (ms)", "later", "{:.0f}"),
        ("TTFT p90, turns 2.. (ms)", "later_p90", "{:.0f}"),
        ("requests/s", "req_s", "{:.2f}"),
        ("prompt tokens/s", "prompt_tok_s", "{:.0f}"),
        ("own cached tokens", "own_hits", "{:.0f}"),
        ("cross-tenant TTFT p50 (ms)", "cross_ms", "{:.0f}"),
        ("cross-tenant cached tokens", "cross", "{:.0f}"),
    ]
    for label, key, fmt in rows:
        print(f"{label:28}{fmt.format(a[key]):>12}{fmt.format(b[key]):>12}")
    failures = cold.failures + warm.failures
    for failure in failures:
        print(f"FAILED {failure}")
    cross = int(a["cross"] + b["cross"])
    speedup = a["later"] / b["later"] if b["later"] else float("nan")
    print(
        f"ttft_p50_cold_ms={a['later']:.0f} ttft_p50_cached_ms={b['later']:.0f} "
        f"speedup={speedup:.2f}x cross_tenant_hits={cross} "
        f"prefix_cache={'on' if cache_on else 'off'}"
    )
    return 1 if failures or cross else 0


if __name__ == "__main__":
    sys.exit(main())
