"""The images' tests (tests/images): the tags `make images` builds, their containers' labels,
and podman as a test runs it."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = os.environ.get("ENGINE_TAG", "localhost/kvfence-engine:dev")
OPERATOR = os.environ.get("OPERATOR_TAG", "localhost/kvfence-operator:dev")
LABEL = "kvfence.dev/test-images"  # on the containers a test runs itself
CLUSTER_LABEL = "kvfence.dev/devcluster"  # on those the test cluster runs (podman.LABEL)
# Every container's name starts with it: the test cluster's (podman.NAME_PREFIX) and a test's
# own, so that a conmon left behind is found by the name on its command line.
NAME_PREFIX = "kvf-"


def podman(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr}"
    return done.stdout


# The README's "On a cluster" commands, in order (tests/e2e/test_readme.py checks the README
# shows exactly these; tests/images/test_install.py runs them).
INSTALL_STEPS = [
    "kubectl apply -f crds/",
    "helm install kvfence charts/kvfence --namespace kvfence-system --create-namespace",
    "$EDITOR examples/cpu-cluster.yaml",
    "kubectl apply -f examples/cpu-cluster.yaml",
    "kubectl wait --for=condition=Ready infd/smollm --timeout=20m",
    "kubectl get infd -o wide",
    """kubectl patch infd smollm --type merge -p '{"spec": {"contextLength": 384}}'""",
    "kubectl wait --for=condition=Progressing=False infd/smollm --timeout=20m",
    "kubectl delete -f examples/cpu-cluster.yaml",
]
