"""Hooks for the whole suite. Fixtures live in each tier's conftest.py, helpers that are not
fixtures in tests/helpers."""

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import torch

from helpers import pool_watch
from helpers.forked import ForkServer
from kvfence_devcluster.processes import ManagedProcess
from kvfence_engine.tools.localproc import LocalProcess


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # No test has a GPU: the device decode kernels (core/paged_decode) run on CPU tensors in
    # Triton's interpreter, which reads this when the kernels are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Two CPUs: in-process models use both, unless xdist workers share them.
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
    # Engines, routers, operators and pods fork from a server that imported them once
    # (helpers/forked.py).
    forks = ForkServer()
    LocalProcess.spawner = forks
    ManagedProcess.spawner = forks.managed


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first: with xdist workers (`make test`), a long test that starts last
    would run alone at the end while the other workers idle. (`--dist loadfile` hands out
    whole files in the order their first test comes: files with a slow test first.)"""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def pool_whole() -> Iterator[None]:
    """No test may leave an engine's KV pool with fewer free pages than it found (see
    helpers/pool_watch.py): a leaked page is capacity another tenant never gets back."""
    before = pool_watch.snapshot()
    yield
    leaked = pool_watch.leaks(before)
    if leaked:
        pytest.fail("KV pages leaked:\n  " + "\n  ".join(leaked), pytrace=False)


LOG_TAIL_LINES = 40
LOG_TAIL_FILES = 8


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries the tails of the process logs written while it ran
    (the router's and engines' own account of a 503, say): CI keeps only what pytest prints."""
    report = yield
    logs = getattr(item, "funcargs", {}).get("logs_dir")
    if report.failed and call.when == "call" and logs is not None:
        for name, tail in log_tails(logs, since=call.start - 1.0):
            report.sections.append((f"log {name} (last {LOG_TAIL_LINES} lines)", tail))
    return report


def log_tails(folder: Path, since: float) -> list[tuple[str, str]]:
    written = [p for p in folder.glob("*.log") if p.stat().st_mtime >= since]
    written.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [
        (p.name, "\n".join(p.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]))
        for p in written[:LOG_TAIL_FILES]
    ]
