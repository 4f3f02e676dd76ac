"""`kvfence up` of a manifest with engine.tensorParallelSize 2 on CPU: each engine is two
processes (gloo), and the real SmolLM2 answers through the router with the openai client. (The
canary against a TP=2 deployment: tests/integration/test_tensor_parallel_serving.py; here it is
off, which only saves its minute.)"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from openai import OpenAI

from helpers.waits import GiveUp, eventually
from kvfence_engine.tools.localproc import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "smollm2-tp2-local.yaml"


def _pgrep(*args: str) -> set[int]:
    out = subprocess.run(["pgrep", *args], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def all_ranks() -> set[int]:
    """Every rank process (ranks 1..N-1) of this user on this machine."""
    return _pgrep("-f", "-u", str(os.getuid()), "kvfence_engine.parallel.launch")


def rank_processes(root: int) -> set[int]:
    """The rank processes among `root`'s descendants: not those of the other tests running
    beside this one."""
    ranks = all_ranks()
    found: set[int] = set()
    todo = [root]
    while todo:
        children = _pgrep("-P", str(todo.pop()))
        found |= children
        todo.extend(children)
    return ranks & found


def test_up_serves_a_tensor_parallel_manifest_and_paris_comes_back(tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert doc["spec"]["engine"]["tensorParallelSize"] == 2
    doc["spec"]["canary"]["enabled"] = False
    manifest = tmp_path / EXAMPLE.name
    manifest.write_text(yaml.safe_dump(doc))
    port = free_port()
    log = tmp_path / "up.out"
    up = subprocess.Popen(
        [sys.executable, "-m", "kvfence_cli", "up", str(manifest), "--port", str(port)],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT,  # noqa: SIM115
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:

        def said() -> str:
            text = log.read_text()
            if "serving: http" not in text and up.poll() is not None:
                raise GiveUp(f"kvfence up exited {up.returncode}:\n{text}")
            return text

        eventually(said, "kvfence up serving", 600, until=lambda t: "serving: http" in t)
        ranks = rank_processes(up.pid)
        assert len(ranks) == 2, log.read_text()  # prefill's rank 1 and decode's
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="kvfence-local")
        answer = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        up.send_signal(signal.SIGINT)
        assert up.wait(120) == 130, log.read_text()
        eventually(lambda: not (all_ranks() & ranks), "the ranks to exit", 30)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
