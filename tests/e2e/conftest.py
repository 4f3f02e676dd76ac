"""The `cluster` fixture: a fresh devcluster (kvfence_devcluster) per test, of hollow pods for a
test marked `@pytest.mark.hollow`; and `operator`: `kvfence operator` on it, watching the
namespace default, with the API keys Secret of tests/helpers/tiny_infd.py in place."""

from collections.abc import Iterator

import pytest

from helpers.operators import Operator, start_operator
from helpers.tiny_infd import api_keys_secret
from kvfence_devcluster.fixtures import (
    Cluster,
    cluster_fixture,  # noqa: F401  (pytest: `cluster`)
)


@pytest.fixture
def operator(cluster: Cluster) -> Iterator[Operator]:
    cluster.create(api_keys_secret())
    running = start_operator(cluster)
    yield running
    running.stop()
