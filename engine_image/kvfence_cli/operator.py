"""`kvfence operator`: the InferenceDeployment operator (kopf underneath)."""

import argparse

from kvfence_cli.common import Subparsers


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("operator", help="run the InferenceDeployment operator (kopf)")
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
        "--liveness", default=None, metavar="URL", help="e.g. http://0.0.0.0:8080/healthz"
    )
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence_operator.command import run_operator

    return run_operator(args)
