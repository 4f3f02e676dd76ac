"""Shared fixtures: an in-process tiny engine, and real `kvfence serve` processes."""

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.faults import Faults
from kvfence_engine.core.request import Request, SamplingParams, is_terminal
from kvfence_engine.loading.loader import TINY_CONFIG, tiny_random
from kvfence_engine.tools.localproc import LocalProcess

# Two CPUs: in-process models use both, unless two xdist workers share them.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

TINY_TOKEN_BYTES = TINY_CONFIG.kv_bytes_per_token(4)


def tiny_budget(pages: int, page_size: int = 16) -> int:
    """The --kv-cache-memory that gives a tiny-random engine exactly `pages` pages."""
    return TINY_TOKEN_BYTES * page_size * pages


def make_tiny_engine(
    *, pages: int = 64, faults: tuple[str, ...] = (), **kwargs: object
) -> LLMEngine:
    args = EngineArgs(
        kv_cache_memory=tiny_budget(pages, int(kwargs.get("page_size", 16))),  # type: ignore[arg-type]
        faults=Faults.from_names(faults, {"KVFENCE_ALLOW_UNSAFE": "1"}),
        **kwargs,  # type: ignore[arg-type]
    )
    return LLMEngine(tiny_random(), args)


@pytest.fixture
def tiny_engine() -> Callable[..., LLMEngine]:
    return make_tiny_engine


def submit(
    engine: LLMEngine, prompt_ids: list[int], max_tokens: int | None = 8, **params: object
) -> Request:
    """Admit and enqueue; returns the sequence (terminal at once if rejected)."""
    sp = SamplingParams(max_tokens=1, **params)  # type: ignore[arg-type]
    seq = engine.admit(prompt_ids, sp, max_tokens=max_tokens)
    if not is_terminal(seq):
        engine.add(seq)
    return seq


def run_until_done(engine: LLMEngine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not drain")


def generate(
    engine: LLMEngine, prompt_ids: list[int], max_tokens: int = 8, **params: object
) -> Request:
    seq = submit(engine, prompt_ids, max_tokens, **params)
    run_until_done(engine)
    return seq


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of exactly `length` ordinary token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (length,), generator=gen).tolist()


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


def serve(logs_dir: Path, name: str, *args: str, unsafe: bool = False) -> LocalProcess:
    env = {"KVFENCE_ALLOW_UNSAFE": "1"} if unsafe else {}
    return LocalProcess(
        ["serve", *args, "--threads", "1"], env=env, log_path=logs_dir / f"{name}.log"
    )


@pytest.fixture(scope="session")
def tiny_server(logs_dir: Path) -> Iterator[LocalProcess]:
    """A real tiny-random engine process, context 512, pool 64 pages of 16."""
    with serve(
        logs_dir,
        "tiny",
        "--model",
        "builtin:tiny-random",
        "--context-length",
        "512",
        "--kv-cache-memory",
        str(tiny_budget(64)),
    ) as proc:
        yield proc


@pytest.fixture(scope="session")
def smollm2_server(logs_dir: Path) -> Iterator[LocalProcess]:
    with serve(
        logs_dir,
        "smollm2",
        "--model",
        "builtin:smollm2-135m-instruct",
        "--kv-cache-memory",
        "256Mi",
    ) as proc:
        yield proc


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first: with two xdist workers (`make test`), a long test that starts last
    would run alone at the end while the other worker idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def metric(url: str, name: str) -> float:
    """One sample of a Prometheus series (name including labels) from url/metrics."""
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} missing from {url}/metrics"
    return float(match.group(1))
