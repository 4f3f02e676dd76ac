"""Hooks for the whole suite, and the fixtures that start real `kvfence serve` processes.
Helpers that are not fixtures live in tests/helpers."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers.engines import tiny_budget
from helpers.processes import serve
from kvfence_engine.tools.localproc import LocalProcess


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


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
    # Two CPUs: in-process models use both, unless two xdist workers share them.
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first: with two xdist workers (`make test`), a long test that starts last
    would run alone at the end while the other worker idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
