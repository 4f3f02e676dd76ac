"""The operator at scale: time to Ready and steady-state API requests for N InferenceDeployments.

For each N (1, 10 and 100 by default) it starts a fresh emulated cluster (kvfence_devcluster)
whose kubelet runs HOLLOW pods (kvfence_devcluster/hollow.py: small stand-ins that answer the
operator's calls, /readyz, /v1/kvpool, the router's backends and a canary verdict, and serve no
model), starts the real operator (`kvfence operator --standalone --all-namespaces`, its
default reconcile interval), creates N InferenceDeployments with their API-keys Secrets, and
measures:

- ready_seconds: from the first create until every one has condition Ready True;
- requests_per_object_per_minute: every request the API server answered over a steady window
  (--window seconds, after --settle seconds), divided by N and by the window in minutes. The
  bench asks nothing during the window, and the test kubelet works on the store directly, so
  what is counted is the operator's load (and any kubectl someone points at the cluster then).
  An operator that cannot keep up with N objects passes over each less often, which lowers
  this figure too: the breakdown's last line gives the API server's whole rate.

What it measures is the operator and the API server, NOT the engines: the pods are hollow. Above
each result line, the same requests by verb and resource (per object per minute), so a change
that cuts the load shows where. The last line is the largest N's:

    objects=100 ready_seconds=S requests_per_object_per_minute=R

Exit status 2 if the cluster or the operator did not get every object Ready in time (the
cluster's folder, with every log, is then kept and named).

    python bench/operator_scale.py                  # N = 1, 10, 100
    python bench/operator_scale.py --quick          # N = 1, 10
    python bench/operator_scale.py --objects 2 --window 10
"""

import argparse
import base64
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfence_devcluster.counting import RequestCounts
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.hollow import HOLLOW_SCRIPT
from kvfence_devcluster.kubelet import KubeletOptions

NAMESPACE = "default"
PREFIX = "scale"
API_KEY = "sk-bench-0123456789"
TINY_KV_BYTES_PER_TOKEN = 768  # builtin:tiny-random, what a hollow engine's pool is made of
KIND = "InferenceDeployment"
API_VERSION = "kvfence.dev/v1alpha1"
IDS_WATCH = ("watch", "inferencedeployments.kvfence.dev")
# Hollow pods answer at once; probing each of hundreds of containers 4 times a second would
# only load this process (the test kubelet runs in it). The operator's pass is 5 s.
PROBE_PERIOD = 1.0


def manifest(name: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "engine": {"kvCacheMemory": str(4096 * TINY_KV_BYTES_PER_TOKEN)},
            "contextLength": 1024,
            "prefill": {"resources": {"requests": {"cpu": "1"}}},
            "decode": {"resources": {"requests": {"cpu": "1"}}},
            "router": {"apiKeysSecret": f"{name}-keys"},
            "canary": {"timeoutSeconds": 120},
        },
    }


def keys_secret(name: str) -> dict[str, Any]:
    keys = base64.b64encode(f"{API_KEY} bench\n".encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-keys", "namespace": NAMESPACE},
        "data": {"api-keys": keys},
    }


@dataclass
class Result:
    objects: int
    ready_seconds: float
    window_seconds: float
    requests: RequestCounts
    containers: int  # started by the kubelet, every one hollow

    def per_object_per_minute(self, count: int) -> float:
        return count / self.objects / (self.window_seconds / 60)

    @property
    def rate(self) -> float:
        return self.per_object_per_minute(self.requests.total)

    def line(self) -> str:
        return (
            f"objects={self.objects} ready_seconds={self.ready_seconds:.1f} "
            f"requests_per_object_per_minute={self.rate:.1f}"
        )

    def breakdown(self) -> list[str]:
        lines = [
            f"objects={self.objects}: {self.containers} containers started, all hollow; "
            f"API requests per object per minute over {self.window_seconds:.0f} s, "
            "by verb and resource:"
        ]
        by_kind = sorted(
            self.requests.by("verb", "resource").items(), key=lambda kv: (-kv[1], kv[0])
        )
        for (verb, resource), count in by_kind:
            lines.append(f"  {self.per_object_per_minute(count):8.1f}  {verb:<16} {resource}")
        agents = sorted(self.requests.by("user_agent").items(), key=lambda kv: -kv[1])
        named = [f"{a or '(none)'} {self.per_object_per_minute(n):.1f}" for (a,), n in agents]
        lines.append("  by user agent: " + (", ".join(named) or "none"))
        # An operator that cannot keep up makes fewer passes per object, so its per-object
        # rate falls as N grows: the server's whole rate says whether that is what happened.
        total = self.requests.total
        lines.append(
            f"  in all: {total} requests in {self.window_seconds:.0f} s, "
            f"{total / self.window_seconds:.1f} per second at the API server"
        )
        return lines


class NotReady(RuntimeError):
    pass


def ready_count(cluster: Cluster) -> tuple[int, list[dict[str, Any]]]:
    objects = cluster.list(KIND, NAMESPACE, api_version=API_VERSION)
    ready = [
        o
        for o in objects
        if any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (o.get("status") or {}).get("conditions") or []
        )
    ]
    return len(ready), [o for o in objects if o not in ready]


def wait_operator_watching(cluster: Cluster, timeout: float) -> None:
    """Until the operator has opened its watch of InferenceDeployments (kopf is up)."""
    deadline = time.monotonic() + timeout
    while cluster.requests().by("verb", "resource").get(IDS_WATCH, 0) == 0:
        if time.monotonic() > deadline:
            raise NotReady(f"the operator did not watch InferenceDeployments in {timeout:g} s")
        time.sleep(0.2)


def measure(
    workdir: Path, objects: int, window: float, settle: float, ready_timeout: float
) -> Result:
    kubelet = KubeletOptions(hollow=True, probe_period=PROBE_PERIOD)
    with start_cluster(workdir, kubelet=kubelet) as cluster:
        operator = cluster.start_operator(["--standalone", "--all-namespaces"])
        wait_operator_watching(cluster, 120)
        names = [f"{PREFIX}-{i:03d}" for i in range(objects)]
        started = time.monotonic()
        for name in names:
            cluster.create(keys_secret(name))
            cluster.create(manifest(name))
        deadline = started + ready_timeout
        while True:
            ready, waiting = ready_count(cluster)
            if ready == objects:
                break
            if operator.poll() is not None:
                raise NotReady(f"the operator exited {operator.poll()}")
            if time.monotonic() > deadline:
                first = waiting[0] if waiting else {}
                conditions = (first.get("status") or {}).get("conditions")
                raise NotReady(
                    f"{ready} of {objects} Ready after {ready_timeout:g} s; "
                    f"{first.get('metadata', {}).get('name')}: {conditions}"
                )
            time.sleep(1.0)
        ready_seconds = time.monotonic() - started
        time.sleep(settle)
        cluster.requests(reset=True)
        time.sleep(window)
        counted = cluster.requests()
        if operator.poll() is not None:
            raise NotReady(f"the operator exited {operator.poll()} during the window")
        problems = cluster.problems()
        if problems:
            raise NotReady("the test cluster failed: " + "; ".join(problems)[:2000])
        assert cluster.kubelet is not None
        started_argvs = [p.argv for p in cluster.kubelet.processes]
        real = [a for a in started_argvs if HOLLOW_SCRIPT not in a]
        if real:
            raise NotReady(f"{len(real)} containers were not hollow, e.g. {' '.join(real[0])}")
        return Result(objects, ready_seconds, window, counted, len(started_argvs))


def parse_objects(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"each number of objects must be >= 1: {text!r}")
    return sorted(counts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--objects",
        type=parse_objects,
        default=[1, 10, 100],
        metavar="N[,N...]",
        help="numbers of InferenceDeployments, one cluster each (default: 1,10,100)",
    )
    parser.add_argument("--quick", action="store_true", help="N = 1 and 10 only")
    parser.add_argument(
        "--window", type=float, default=60.0, help="steady window, seconds (default: 60)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds after all are Ready before the window opens (default: 10)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=None,
        help="seconds for all to be Ready (default: 120 + 6 per object)",
    )
    args = parser.parse_args(argv)
    counts = [1, 10] if args.quick else args.objects
    if args.window <= 0 or args.settle < 0:
        parser.error("--window must be > 0 and --settle >= 0")

    workdir = Path(tempfile.mkdtemp(prefix="operator-scale-"))
    failed = True
    try:
        results = []
        for n in counts:
            timeout = args.ready_timeout or 120 + 6 * n
            result = measure(workdir / f"objects-{n}", n, args.window, args.settle, timeout)
            results.append(result)
            print("\n".join(result.breakdown()), flush=True)
            print(result.line(), flush=True)
        failed = False
        return 0
    except NotReady as exc:
        print(f"operator_scale: {exc}", file=sys.stderr)
        return 2
    finally:
        if failed:
            print(f"operator_scale: the clusters' logs are kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
