"""Fixtures that start real `kvfence serve` processes, shared by the integration tests."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.deployments import Deployment, start_deployment
from helpers.engines import tiny_budget
from helpers.fuzzing import FUZZ_CONTEXT, FUZZ_KEY, FUZZ_TOKEN
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


@pytest.fixture(scope="session")
def fuzz_server(logs_dir: Path) -> Iterator[LocalProcess]:
    """A tiny-random engine process, context FUZZ_CONTEXT, pool 64 pages of 16."""
    args = ["--model", "builtin:tiny-random", "--context-length", str(FUZZ_CONTEXT)]
    with serve(logs_dir, "fuzz-combined", *args, "--kv-cache-memory", str(tiny_budget(64))) as proc:
        yield proc


@pytest.fixture(scope="session")
def fuzz_deployment(
    logs_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """Router + prefill + decode of tiny-random, context FUZZ_CONTEXT, internal token on, one
    tenant whose key is FUZZ_KEY."""
    folder = tmp_path_factory.mktemp("fuzz-deployment")
    (folder / "keys").write_text(f"{FUZZ_KEY} fuzzer\n")
    (folder / "token").write_text(FUZZ_TOKEN + "\n")
    d = start_deployment(
        logs_dir,
        "fuzz",
        context=FUZZ_CONTEXT,
        router_args=["--api-keys", str(folder / "keys")],
        token_file=folder / "token",
    )
    yield d
    d.stop()
