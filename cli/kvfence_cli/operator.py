"""`kvfence operator`: the InferenceDeployment operator (kopf underneath)."""

import argparse

from kvfence_cli.common import Subparsers

EPILOG = """\
examples:
  kvfence operator --standalone --namespace default
  kvfence operator --liveness http://0.0.0.0:8080/healthz --leader-elect \
      --metrics http://0.0.0.0:9090/metrics                              # as the chart runs it

leader election (--leader-elect): replicas campaign for a coordination.k8s.io/v1 Lease;
only its holder runs kopf, the others stand by (their liveness URL answers meanwhile).
Lease duration 15 s, renew deadline 10 s, retry period 2 s; holder identity: $POD_NAME,
else the host name and a random suffix. A leader that cannot renew within the deadline
exits 1 at once (the kubelet restarts it as a standby); stopped, it releases the lease.

exit codes:
  0  stopped (Ctrl-C or SIGTERM)
  1  lost the lease (--leader-elect): another replica leads, or it could not renew in time
  2  no cluster access (neither config works), a --metrics URL that is not
     http://HOST:PORT/PATH or whose address is in use, or kopf could not start"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "operator",
        help="run the InferenceDeployment operator (kopf)",
        description="Run the InferenceDeployment operator (kopf underneath): it reconciles each "
        "InferenceDeployment into engine and router Deployments, keeps a pod out of service "
        "until its KV pool holds the context, canaries each revision and then promotes it. "
        "Cluster access: the pod's service account, else $KUBECONFIG or ~/.kube/config.",
        epilog=EPILOG,
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", action="append", default=[], metavar="NS", help="watch NS (repeatable)"
    )
    scope.add_argument(
        "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="no kopf peering (implied by --leader-elect)",
    )
    p.add_argument(
        "--leader-elect",
        action="store_true",
        help="reconcile only while holding the leader Lease (run several replicas)",
    )
    p.add_argument(
        "--leader-elect-lease",
        default="kvfence-operator",
        metavar="NAME",
        help="the Lease's name (default: kvfence-operator)",
    )
    p.add_argument(
        "--leader-elect-namespace",
        default=None,
        metavar="NS",
        help="the Lease's namespace (default: $OPERATOR_NAMESPACE, else kvfence-system)",
    )
    p.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz (default: none)",
    )
    p.add_argument(
        "--metrics",
        default=None,
        metavar="URL",
        help="serve Prometheus metrics here, e.g. http://0.0.0.0:9090/metrics: reconcile passes "
        "per InferenceDeployment and their durations (default: none)",
    )
    p.add_argument("--verbose", action="store_true", help="log at DEBUG (kopf's own steps too)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence_operator.app.command import run_operator

    return run_operator(args)
