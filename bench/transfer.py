"""KV transfer throughput and time to first token, disaggregated vs combined.

Part 1 moves the KV of one long SmolLM2 prompt (fp32, ~46 KB/token) from a sender to a real
decode engine's KV receiver over loopback TCP, with per-page checksums on and off, and copies
the same number of bytes over a raw loopback socket in the same run. Rounds are interleaved;
medians are reported, and the ratio to the raw socket is what matters on a noisy machine.

Part 2 starts a combined engine and a router + prefill + decode deployment (real processes,
same SmolLM2 weights) and measures time to first token for the same prompts through each.
"""

import argparse
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import torch

from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.request import SamplingParams
from kvfence_engine.disagg.receiver import KVReceiver
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.disagg.transfer import Layout, send_kv
from kvfence_engine.loading.loader import load_model
from kvfence_engine.loading.tokenizer_source import SMOLLM2
from kvfence_engine.tools.localproc import LocalProcess


def raw_copy(num_bytes: int) -> float:
    """Seconds to push num_bytes through a loopback TCP socket into a receiving buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    sink = bytearray(1 << 20)
    done = threading.Event()

    def receive() -> None:
        conn, _ = listener.accept()
        view, left = memoryview(sink), num_bytes
        while left:
            left -= conn.recv_into(view, min(len(sink), left))
        conn.sendall(b"k")
        conn.close()
        done.set()

    thread = threading.Thread(target=receive)
    thread.start()
    payload = bytes(num_bytes)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(payload)
        sock.recv(1)
    elapsed = time.perf_counter() - start
    thread.join()
    listener.close()
    return elapsed


def kv_transfer(book: DecodeReservations, tokens: int, verify: bool, round_no: int) -> float:
    engine = book.engine
    engine.args.kv_checksum = verify
    seq = engine.admit(list(range(100, 100 + tokens)), SamplingParams(max_tokens=1), max_tokens=1)
    handle = book.reserve(seq, f"bench-{round_no}-{verify}")
    pages = engine.pages.pages_for(tokens)
    layout = Layout.of(engine.pages.kv)
    shape = (pages, layout.layers, layout.page_size, layout.kv_heads, layout.head_dim)
    k, v = torch.randn(shape), torch.randn(shape)
    start = time.perf_counter()
    send_kv(handle, k, v, tokens, layout, token=None, verify=verify)
    elapsed = time.perf_counter() - start
    book.abort(handle.request_id)
    return elapsed


def part_transfer(tokens: int, rounds: int) -> None:
    engine = LLMEngine(load_model(SMOLLM2), EngineArgs(role="decode", kv_cache_memory=1 << 30))
    book = DecodeReservations(engine)
    receiver = KVReceiver(book, "127.0.0.1", 0, None)
    receiver.start()
    engine.args.transfer_port = receiver.port
    nbytes = engine.pages.pages_for(tokens) * Layout.of(engine.pages.kv).page_bytes
    times: dict[str, list[float]] = {"raw socket": [], "checksums on": [], "checksums off": []}
    for r in range(rounds):
        times["raw socket"].append(raw_copy(nbytes))
        times["checksums on"].append(kv_transfer(book, tokens, True, r))
        times["checksums off"].append(kv_transfer(book, tokens, False, r))
    receiver.stop()
    raw = nbytes / statistics.median(times["raw socket"])
    print(
        f"\nKV transfer of {tokens} SmolLM2 tokens ({nbytes / 2**20:.0f} MiB), "
        f"median of {rounds} interleaved rounds"
    )
    print(f"{'path':<16}{'GB/s':>8}{'vs raw':>9}")
    for name, values in times.items():
        rate = nbytes / statistics.median(values)
        print(f"{name:<16}{rate / 1e9:>8.2f}{rate / raw:>8.0%}")
    on = nbytes / statistics.median(times["checksums on"]) / raw
    print(f"target: checksums on >= 50% of raw socket -> {'met' if on >= 0.5 else 'NOT met'}")


def ttft(url: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
        "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
    }) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError(f"no token from {url}")


def part_ttft(lengths: list[int], reps: int, logs: Path) -> None:
    common = ["--model", SMOLLM2, "--kv-cache-memory", "512Mi", "--threads", "2"]
    combined = LocalProcess(["serve", *common], log_path=logs / "combined.log")
    decode = LocalProcess(
        ["serve", "--role", "decode", "--transfer-port", "0", *common], log_path=logs / "decode.log"
    )
    prefill = LocalProcess(["serve", "--role", "prefill", *common], log_path=logs / "prefill.log")
    procs = [combined, decode, prefill]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(300)
        router = LocalProcess(
            ["router", "--model", SMOLLM2, "--prefill", prefill.url, "--decode", decode.url],
            log_path=logs / "router.log",
        )
        procs.append(router.start().wait_ready(120))
        print(f"\ntime to first token, median of {reps} (streaming, one request at a time)")
        print(f"{'prompt tokens':>14}{'combined s':>12}{'disagg s':>10}{'ratio':>8}")
        for n in lengths:
            prompt = list(range(1000, 1000 + n))
            ttft(combined.url, prompt), ttft(router.url, prompt)  # warm up
            a = statistics.median(ttft(combined.url, prompt) for _ in range(reps))
            b = statistics.median(ttft(router.url, prompt) for _ in range(reps))
            print(f"{n:>14}{a:>12.3f}{b:>10.3f}{b / a:>7.2f}x")
    finally:
        for p in procs:
            p.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/kvfence-bench-transfer"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    part_transfer(1024 if args.quick else args.tokens, 3 if args.quick else args.rounds)
    part_ttft([64, 512] if args.quick else [64, 512, 2048], 2 if args.quick else 3, args.logs)


if __name__ == "__main__":
    main()
