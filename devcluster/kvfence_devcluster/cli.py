"""`kvfence-devcluster`: the test cluster as a command, for kubectl and a person at a shell.

It starts the API server, the kubelet (pods as processes, or with --runtime podman as
containers of their images) and the kube-proxy (and, with --operator,
`kvfence operator` against them), writes the kubeconfig once all of them answer, prints one
line saying how to use it, and runs until SIGINT or SIGTERM; then it stops every process it
started (pods and operator) and removes the kubeconfig it wrote. The operator finds its
resource only at start (it watches no CRDs), so without --install-crds it starts once
`kubectl apply -f crds/` has established the InferenceDeployment CRD.
"""

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import httpx
import yaml

from kvfence_engine.tools import http_clients
from kvfence_engine.tools.localproc import free_port

from .apiserver import INFERENCE_DEPLOYMENT_CRD, write_kubeconfig
from .fixtures import Cluster, start_cluster
from .options import RUNTIMES, KubeletOptions
from .processes import ManagedProcess

PROG = "kvfence-devcluster"
CLUSTER_NAME = "kvfence-test"  # the cluster write_kubeconfig names: how a kubeconfig is ours
START_TIMEOUT = 120.0  # seconds for the operator to answer its liveness endpoint
EXIT_CODES = """\
exit codes:
  0  stopped by SIGINT or SIGTERM; every process it started was stopped
  1  the cluster or the operator did not start, or the operator exited while running
  2  bad usage, e.g. --kubeconfig names a file that this command did not write
"""


class StartError(Exception):
    """What kept the cluster from starting, in one line."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Run kvfence's emulated Kubernetes cluster on this machine: an API server, a "
            "kubelet that runs pods as local processes and a kube-proxy that makes each "
            "Service's clusterIP (a 127.0.x.y address) reach its ready pods. Like a new real "
            "cluster it starts without kvfence's CRD: `kubectl apply -f crds/`."
        ),
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--kubeconfig",
        required=True,
        type=Path,
        metavar="PATH",
        help="where to write the kubeconfig, once everything answers (removed on exit)",
    )
    parser.add_argument(
        "--operator",
        action="store_true",
        help="also run `kvfence operator --standalone --all-namespaces` against the cluster, "
        "once the InferenceDeployment CRD is established",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="pods' directories and every log, kept on exit (default: a temporary folder, "
        "removed on exit)",
    )
    parser.add_argument(
        "--grace-cap",
        type=float,
        default=KubeletOptions.grace_cap,
        metavar="SECONDS",
        help="stop a deleted pod's containers at the latest this long after its deletion, "
        "whatever its terminationGracePeriodSeconds (its preStop included); raise it to let "
        "pods drain as they would on a real cluster (default: %(default)g)",
    )
    parser.add_argument(
        "--install-crds",
        action="store_true",
        help=f"install {INFERENCE_DEPLOYMENT_CRD.name} at start instead of waiting for kubectl",
    )
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="process",
        help="how pods' containers run: as local processes (the default; no image needed) or "
        "as podman containers of their images, which must be on this machine (`make images`; "
        "podman's storage and configuration as images/podman-env.sh sets them) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--hollow",
        action="store_true",
        help="hollow pods: each kvfence container runs a small stand-in that answers the "
        "operator's and the kubelet's calls and serves no model (for load tests of the "
        "operator and the API server, not of the engines)",
    )
    return parser


def _ours(path: Path) -> bool:
    """Whether `path` is absent or a kubeconfig this command wrote (so it may be replaced)."""
    if not path.exists():
        return True
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    clusters = config.get("clusters") if isinstance(config, dict) else None
    return isinstance(clusters, list) and [c.get("name") for c in clusters] == [CLUSTER_NAME]


def _start_operator(cluster: Cluster, stop: threading.Event) -> ManagedProcess:
    """`kvfence operator`, once it answers its liveness endpoint."""
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    operator = cluster.start_operator(["--standalone", "--all-namespaces", "--liveness", liveness])
    deadline = time.monotonic() + START_TIMEOUT
    while not stop.is_set():
        if (code := operator.poll()) is not None:
            raise StartError(f"the operator exited with code {code}; see {operator.log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if http_clients.get(liveness, timeout=1.0).status_code == 200:
                return operator
        if time.monotonic() > deadline:
            raise StartError(
                f"the operator did not answer {liveness} in {START_TIMEOUT:g}s; "
                f"see {operator.log_path}"
            )
        stop.wait(0.2)
    return operator


def _crd_established(cluster: Cluster) -> bool:
    name = yaml.safe_load(INFERENCE_DEPLOYMENT_CRD.read_text())["metadata"]["name"]
    crd = cluster.get("CustomResourceDefinition", name)
    return crd is not None and any(
        c["type"] == "Established" and c["status"] == "True"
        for c in (crd.get("status") or {}).get("conditions") or []
    )


def _serve(args: argparse.Namespace, state: Path, stop: threading.Event) -> int:
    crds = (INFERENCE_DEPLOYMENT_CRD,) if args.install_crds else ()
    kubelet = KubeletOptions(grace_cap=args.grace_cap, hollow=args.hollow, runtime=args.runtime)
    with start_cluster(state / "cluster", crds=crds, kubelet=kubelet) as cluster:
        # The operator watches no CRDs (it finds its resource once, at start, as kopf does
        # with scanning off), so it starts once its CRD is established, as after a chart's crds/.
        operator = _start_operator(cluster, stop) if args.operator and args.install_crds else None
        if stop.is_set():
            return 0
        try:
            http_clients.get(cluster.url + "/api", timeout=5.0).raise_for_status()
        except httpx.HTTPError as exc:
            raise StartError(f"the API server at {cluster.url} does not answer: {exc}") from None
        try:
            kubeconfig = write_kubeconfig(args.kubeconfig, cluster.url)
        except OSError as exc:
            raise StartError(
                f"cannot write the kubeconfig {args.kubeconfig}: {exc.strerror or exc}"
            ) from None
        try:
            waiting = args.operator and operator is None
            print(
                f"{PROG}: cluster at {cluster.url}, logs in {cluster.logs_dir}; "
                + ("hollow pods (stand-ins, no engines); " if args.hollow else "")
                + f"use it with: export KUBECONFIG={kubeconfig.resolve()}"
                + (
                    "; the operator starts once `kubectl apply -f crds/` is done" if waiting else ""
                ),
                flush=True,
            )
            while not stop.wait(0.5):
                if args.operator and operator is None and _crd_established(cluster):
                    operator = _start_operator(cluster, stop)
                    print(f"{PROG}: the operator is running", flush=True)
                if operator is not None and (code := operator.poll()) is not None:
                    print(
                        f"{PROG}: error: the operator exited with code {code}; "
                        f"see {operator.log_path}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
            return 0
        finally:
            kubeconfig.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.hollow and args.runtime != "process":
        parser.error("--hollow runs stand-ins as processes: it takes no --runtime podman")
    if not _ours(args.kubeconfig):
        print(
            f"{PROG}: error: {args.kubeconfig} exists and is not a kubeconfig {PROG} wrote; "
            "refusing to overwrite it",
            file=sys.stderr,
        )
        return 2
    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    state = args.state_dir or Path(tempfile.mkdtemp(prefix=f"{PROG}-"))
    try:
        return _serve(args, state, stop)
    except (StartError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # a fault of the emulator itself: still one line, then exit
        print(f"{PROG}: error: the cluster failed: {exc!r}", file=sys.stderr, flush=True)
        return 1
    finally:
        if args.state_dir is None:
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
