"""`kvfence operator`: kopf underneath, with the options a Deployment needs."""

import argparse
import sys


def add_operator_command(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    import logging

    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    if args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    try:
        kopf.run(
            standalone=args.standalone,
            liveness_endpoint=args.liveness,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
        )
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # kopf's login and startup errors: say what failed and exit
        print(f"kvfence operator: {exc}", file=sys.stderr)
        return 2
    return 0
