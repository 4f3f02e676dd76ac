"""Hooks for the whole suite. Fixtures live in each tier's conftest.py, helpers that are not
fixtures in tests/helpers."""

import os
from collections.abc import Iterator

import pytest
import torch

from helpers import pool_watch


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Two CPUs: in-process models use both, unless two xdist workers share them.
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first: with two xdist workers (`make test`), a long test that starts last
    would run alone at the end while the other worker idles."""
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
