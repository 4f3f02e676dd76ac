"""`kvfence operator`: kopf underneath, with the options a Deployment needs."""

import argparse
import sys


def run_operator(args: argparse.Namespace) -> int:
    import logging

    import kopf

    from kvfence_operator import handlers  # noqa: F401  (registers the handlers)
    from kvfence_operator.kube import NoClusterAccess, load_cluster_config

    try:  # before kopf, whose startup handler would retry it every 60 s with a traceback
        load_cluster_config()
    except NoClusterAccess as exc:
        print(f"kvfence operator: {exc}", file=sys.stderr)
        return 2
    if args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    try:
        kopf.run(
            standalone=args.standalone,
            liveness_endpoint=args.liveness,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            memo=kopf.Memo(namespaces=args.namespace),  # the child caches watch the same
        )
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # kopf's login and startup errors: say what failed and exit
        print(f"kvfence operator: {exc}", file=sys.stderr)
        return 2
    return 0
