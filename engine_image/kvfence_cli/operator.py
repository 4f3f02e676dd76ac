"""`kvfence operator`: the InferenceDeployment operator (kopf underneath)."""

import argparse

from kvfence_cli.common import Subparsers

EPILOG = """\
examples:
  kvfence operator --standalone --namespace default
  kvfence operator --liveness http://0.0.0.0:8080/healthz   # as the chart runs it

exit codes:
  0  stopped (Ctrl-C or SIGTERM)
  2  no cluster access (neither config works), or kopf could not start"""


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
        help="no peering: the chart runs one replica with strategy Recreate",
    )
    p.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz (default: none)",
    )
    p.add_argument("--verbose", action="store_true", help="log at DEBUG (kopf's own steps too)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence_operator.command import run_operator

    return run_operator(args)
