"""The router's CPU time per answered token, for a 4,000-token streamed answer against a
500-token one (issue 33, finding 4: the router re-decoded the whole answer for every token, so
a 4,000-token stream cost it 9 s of CPU against 5 s for ten 400-token streams).

Processes: `kvfence serve --role prefill`, `kvfence serve --role decode` and `kvfence router` on
loopback (kvfence_engine.tools.localproc), builtin:tiny-random (SmolLM2's tokenizer) with a
4,096-token context (all its positions). Each answer is a greedy completion streamed with
`ignore_eos`, so it is exactly max_tokens long (checked on its usage). The router's CPU is
its process's utime + stime (/proc/<pid>/stat, every thread, in clock ticks) read before and
after each answer; the answers of one length run one after the other until --tokens tokens
(4,000: one 4,000-token answer, eight 500-token ones), and the per-token figure is their CPU
over their tokens. The router's idle CPU (its own timers) is measured too and printed, not
subtracted. The last line:

    cpu=AVX2 router_us_per_token_500=.. router_us_per_token_4000=.. ratio=..x

where ratio is the per-token cost at 4,000 tokens over that at 500 (linear detokenization:
about 1x, fixed per-request costs make it lower). Exit status 1 if it is over 1.5 or an answer
was not exactly its max_tokens long. About 1-2 minutes on 2 cores.

    python bench/router_detok_cpu.py
    python bench/router_detok_cpu.py --tokens 8000
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from kvfence_engine.tools.localproc import LocalProcess, wait_all_ready

CONTEXT = 4096  # tiny-random's positions: a 4,000-token answer and its prompt fit
LENGTHS = (500, 4000)
MAX_RATIO = 1.5
PROMPT = "The quick brown fox"


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads, live and ended)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def streamed_tokens(client: httpx.Client, max_tokens: int) -> tuple[int, int]:
    """One greedy streamed completion of exactly `max_tokens`: (its usage's completion_tokens,
    how many text chunks it came in)."""
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, chunks = -1, 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{r.status_code} {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("choices"):
                chunks += 1
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    return tokens, chunks


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokens", type=int, default=4000, help="answered tokens per length (default 4000)"
    )
    parser.add_argument("--model", default="builtin:tiny-random")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="kvfence-detok-cpu-"))
    token = folder / "token"
    token.write_text("router-detok-cpu-internal-token\n")
    common = ["--model", args.model, "--context-length", str(CONTEXT)]
    common += ["--internal-token-file", str(token)]
    engine = [*common, "--kv-cache-memory", "256Mi", "--transfer-port", "0", "--threads", "1"]
    prefill = LocalProcess(["serve", "--role", "prefill", *engine], log_path=folder / "prefill.log")
    decode = LocalProcess(["serve", "--role", "decode", *engine], log_path=folder / "decode.log")
    router = LocalProcess(
        ["router", *common, "--prefill", prefill.url, "--decode", decode.url],
        log_path=folder / "router.log",
    )
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"model {args.model}, context {CONTEXT}, CPU {cpu}; logs in {folder}")
    procs = [prefill, decode, router]
    per_token: dict[int, float] = {}
    ok = True
    try:
        for proc in procs:
            proc.start()
        wait_all_ready({p.url: p for p in procs}, timeout=300)
        assert router.proc is not None
        pid = router.proc.pid
        with httpx.Client(base_url=router.url, timeout=600) as client:
            streamed_tokens(client, 16)  # warm-up: first-request costs out of the figures
            start, idle = time.monotonic(), cpu_seconds(pid)
            time.sleep(2.0)
            idle_rate = (cpu_seconds(pid) - idle) / (time.monotonic() - start)
            print(f"router idle: {idle_rate * 1e3:.1f} ms of CPU per second")
            print(f"{'answer tokens':>14} {'answers':>8} {'router CPU s':>13} {'us/token':>9}")
            for length in LENGTHS:
                answers = max(1, args.tokens // length)
                used, tokens, wall = 0.0, 0, 0.0
                for _ in range(answers):
                    began, before = time.monotonic(), cpu_seconds(pid)
                    got, _chunks = streamed_tokens(client, length)
                    used += cpu_seconds(pid) - before
                    wall += time.monotonic() - began
                    tokens += got
                    if got != length:
                        print(f"an answer of {got} tokens, asked for exactly {length}")
                        ok = False
                per_token[length] = used / tokens
                print(
                    f"{length:>14} {answers:>8} {used:>13.2f} {per_token[length] * 1e6:>9.1f}"
                    f"   ({tokens / wall:.0f} tokens/s)"
                )
    finally:
        for proc in procs:
            proc.stop()
    ratio = per_token[4000] / per_token[500]
    print(
        f"cpu={cpu} router_us_per_token_500={per_token[500] * 1e6:.1f} "
        f"router_us_per_token_4000={per_token[4000] * 1e6:.1f} ratio={ratio:.2f}x"
    )
    ok = ok and ratio <= MAX_RATIO
    print("verdict: " + ("PASS" if ok else f"FAIL (ratio over {MAX_RATIO}x or a short answer)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
