"""What a test sets on its kubelet (kubelet.Kubelet): timings, the environment of pods, the
command-line changes a test makes, hollow pods."""

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

RUNTIMES = ("process", "podman")
Runtime = Literal["process", "podman"]


def _default_env() -> dict[str, str]:
    """One torch thread per engine: several share two cores."""
    return {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def host_cache_env() -> dict[str, str]:
    """The machine's kvfence cache, for pods that run as processes here: a pod's HOME is
    fresh, and a cold tokenizer cache costs each engine seconds at start. (A container's
    file system is its image's and its volumes: it gets none of this machine's folders.)"""
    cache = os.environ.get("KVFENCE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvfence"
    )
    return {"KVFENCE_CACHE_DIR": cache}


@dataclass
class KubeletOptions:
    allow_unsafe: bool = True  # KVFENCE_ALLOW_UNSAFE=1, so tests can deploy --unsafe-fault
    extra_env: Mapping[str, str] = field(default_factory=_default_env)
    probe_period: float = 0.25  # seconds between readiness probes (instead of periodSeconds)
    restart_backoff: float = 0.5  # first restart delay; doubles up to max_restart_backoff
    max_restart_backoff: float = 8.0
    # terminationGracePeriodSeconds (preStop included) is capped at this: raise it for a test
    # of a drain; teardown skips preStop sleeps and cuts every drain to 2 s whatever it is
    grace_cap: float = 5.0
    tick: float = 0.2  # controllers run at least this often (Job deadlines)
    claims: Mapping[str, Path] = field(default_factory=dict)  # PVC name -> local directory
    node_name: str = "kvfence-test-node"
    default_command: tuple[str, ...] = ("kvfence",)  # for containers without `command`
    # What a test changes in a pod's command line before it starts: e.g. an --unsafe-fault in
    # one revision's engines, which no InferenceDeployment can ask for (the CRD forbids it).
    amend_argv: Callable[[dict[str, Any], list[str]], list[str]] | None = None
    # Seconds a changed ConfigMap waits before a running pod's configMap volume shows it. The
    # real kubelet refreshes these volumes on its sync period and cache TTL, about a minute
    # after the change; 0 (the default) rewrites the files on the pod's next pass.
    configmap_volume_lag: float = 0.0
    # Hollow pods (hollow.py): every `kvfence` container runs a small stand-in that answers
    # what the operator and the kubelet ask (health, readiness, /v1/kvpool, the router's
    # backends, a canary verdict) and serves no model: for benches of the operator and the
    # API server at a scale real engines cannot reach on one machine (bench/operator_scale.py).
    hollow: bool = False
    # How containers run: "process", as local processes (the default: no image needed, and a
    # pod's paths and commands are mapped to this machine's, sandbox.py); "podman", as podman
    # containers of the pod's image (podman.py), for the images' own tests.
    runtime: Runtime = "process"
