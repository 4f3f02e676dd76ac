"""The `cluster` fixture: a fresh devcluster (kvfence_devcluster) per test."""

from kvfence_devcluster.fixtures import cluster_fixture  # noqa: F401  (pytest: `cluster`)
