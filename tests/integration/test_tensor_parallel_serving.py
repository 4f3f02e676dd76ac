"""Tensor-parallel engines as real processes (`kvfence serve --tensor-parallel-size 2`, gloo
over loopback, tiny-random): a TP=2 deployment answers through the router what a TP=1 engine
does, the canary passes it and fails one whose decode has a fault on one rank alone, and a
rank that dies ends its engine."""

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from helpers.deployments import Deployment, start_deployment, two_tenant_router_args
from helpers.waits import eventually
from kvfence_engine.canary import CanaryConfig, run_canary
from kvfence_engine.tools import http_clients
from kvfence_engine.tools.localproc import LocalProcess

KEY_A, KEY_B, TOKEN = "tp-key-a", "tp-key-b", "tp-internal-token"
TP2 = ["--tensor-parallel-size", "2"]
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def router_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return two_tenant_router_args(tmp_path_factory.mktemp("tp"), KEY_A, KEY_B, TOKEN)


@pytest.fixture(scope="module")
def tp2(logs_dir: Path, router_args: list[str]) -> Iterator[Deployment]:
    d = start_deployment(logs_dir, "tp2", context=1024, router_args=router_args, engine_args=TP2)
    yield d
    d.stop()


def answers(url: str, key: str) -> list[str]:
    client = OpenAI(base_url=url + "/v1", api_key=key)
    out = []
    for prompt in PROMPTS:
        r = client.completions.create(
            model="tiny-random", prompt=prompt, max_tokens=64, temperature=0
        )
        out.append(r.choices[0].text)
    return out


def test_a_tp2_deployment_answers_what_a_tp1_engine_does(
    tp2: Deployment, tiny_server: LocalProcess
) -> None:
    """64 greedy tokens per prompt through the router (prefill and decode each TP=2; the KV
    pages travel whole between them), against one TP=1 engine of the same model."""
    assert answers(tp2.router.url, KEY_A) == answers(tiny_server.url, "unused")
    for engine in (*tp2.prefills, *tp2.decodes):
        report = http_clients.get(
            engine.url + "/v1/kvpool", headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()
        assert report["tensor_parallel_size"] == 2


def canary(url: str) -> dict[str, str]:
    """One round (each broken case shows in the first); the failed checks and why."""
    config = CanaryConfig(url, KEY_A, KEY_B, internal_token=TOKEN, rounds=1)
    report = run_canary(config)
    print(report.human())
    return {c.name: c.reason for c in report.checks if not c.passed}


def test_the_canary_passes_a_tp2_deployment(tp2: Deployment) -> None:
    assert canary(tp2.router.url) == {}


def test_the_canary_fails_a_tp2_deployment_with_a_fault_on_one_rank_and_a_dead_rank_ends_it(
    logs_dir: Path, router_args: list[str]
) -> None:
    """rank-desync on decode: its rank 1 stops following rank 0's page bookkeeping. Rank 0's
    read check alone would pass every request; rank 1's refuses, on both ranks. Then a group
    short of a rank, which computes nothing: prefill's rank 1 killed, its rank 0 exits 1 with
    why (its pod restarts whole); decode's rank 0 killed, its rank 1 exits by itself."""
    d = start_deployment(
        logs_dir,
        "tp2-desync",
        context=1024,
        router_args=router_args,
        engine_args=TP2,
        decode_faults=["rank-desync"],
    )
    try:
        failed = canary(d.router.url)
        assert failed, "the canary passed a deployment whose decode rank 1 reads pages it lost"
        assert "kv_isolation_violation" in " ".join(failed.values()), failed
        prefill, decode = d.prefills[0], d.decodes[0]
        assert prefill.proc is not None and decode.proc is not None
        (rank1,) = ranks_of(prefill.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert prefill.proc.wait(timeout=30) == 1
        assert prefill.log_path is not None
        assert "rank 1 of 2 ended (exit code -9)" in prefill.log_path.read_text()
        (follower,) = ranks_of(decode.proc.pid)
        os.kill(decode.proc.pid, signal.SIGKILL)
        eventually(lambda: not alive(follower), "decode's rank 1 to exit", timeout=15)
    finally:
        d.stop()


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(line) for line in out.split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def ranks_of(pid: int) -> list[int]:
    """The rank processes an engine started."""
    cmdline = lambda c: Path(f"/proc/{c}/cmdline").read_bytes()  # noqa: E731
    return [c for c in children(pid) if b"kvfence_engine.parallel" in cmdline(c)]
