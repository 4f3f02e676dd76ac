"""What the image tests share: podman's environment (images/podman-env.sh), both images built
as `make images` builds them, and a sweep that fails a test which left a container running."""

import os
import subprocess
from collections.abc import Iterator

import pytest

from helpers.images import CLUSTER_LABEL, LABEL, NAME_PREFIX, ROOT, podman
from helpers.waits import eventually


@pytest.fixture(scope="session")
def podman_env() -> Iterator[dict[str, str]]:
    """The environment images/podman-env.sh sets up (its storage and configuration), also
    set in this process's for the test cluster's podman runtime."""
    shown = subprocess.run(
        ["bash", "-c", ". images/podman-env.sh && env -0"],
        cwd=ROOT, capture_output=True, check=True,
    )  # fmt: skip
    env = dict(line.split("=", 1) for line in shown.stdout.decode().split("\0") if "=" in line)
    podman_vars = {k: v for k, v in env.items() if k.startswith("CONTAINERS_")}
    saved = {k: os.environ.get(k) for k in podman_vars}
    os.environ.update(podman_vars)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def built(podman_env: dict[str, str]) -> None:
    """Both images, as `make images` builds them (cached layers reused)."""
    subprocess.run(["images/build.sh"], cwd=ROOT, env=podman_env, check=True, timeout=1200)


@pytest.fixture
def swept(podman_env: dict[str, str]) -> Iterator[None]:
    """After the test: remove what its own containers left, then fail if any container, or
    any conmon (found by its container's name), of a test or of a test cluster is still there."""
    yield
    subprocess.run(["podman", "rm", "-f", "--time", "5", "--filter", f"label={LABEL}"],
                   env=podman_env, capture_output=True, timeout=120)  # fmt: skip
    for label in (LABEL, CLUSTER_LABEL):
        left = podman(podman_env, "ps", "-a", "-q", "--filter", f"label={label}")
        assert not left.split(), f"containers left ({label}): {left}"
    eventually(  # a conmon exits a moment after its container
        lambda: subprocess.run(
            ["pgrep", "-f", f"conmon .* -n {NAME_PREFIX}"], capture_output=True, text=True
        ).stdout.split(),
        "every conmon of a test's container to exit",
        15,
        until=lambda pids: not pids,
    )
