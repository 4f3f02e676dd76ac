"""`kvfence operator`: kopf underneath, with the options a Deployment needs."""

import argparse
import os
import sys


def run_operator(args: argparse.Namespace) -> int:
    import logging

    import kopf

    from kvfence_operator.app import handlers  # noqa: F401  (registers the handlers)
    from kvfence_operator.app.handlers import OPERATOR_NAMESPACE_ENV
    from kvfence_operator.cluster.kube import NoClusterAccess, load_cluster_config
    from kvfence_operator.cluster.leader import Election, Leadership, Stopped, default_identity
    from kvfence_operator.cluster.metrics_token import SCRAPERS_ENV, scrapers_from

    try:  # before kopf, whose startup handler would retry it every 60 s with a traceback
        load_cluster_config()
        scrapers_from(os.environ.get(SCRAPERS_ENV))
    except (NoClusterAccess, ValueError) as exc:
        print(f"kvfence operator: {exc}", file=sys.stderr)
        return 2
    if args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    else:  # the library logs every try of a standby at INFO; ours says what changes
        logging.getLogger("leaderelection").setLevel(logging.WARNING)
    leadership: Leadership | None = None
    if args.leader_elect:
        namespace = args.leader_elect_namespace or os.environ.get(
            OPERATOR_NAMESPACE_ENV, "kvfence-system"
        )
        election = Election(args.leader_elect_lease, namespace, default_identity())
        try:
            leadership = election.campaign(liveness=args.liveness)
        except Stopped:
            return 0
        leadership.keep()
    try:
        kopf.run(
            standalone=args.standalone or args.leader_elect,
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
    finally:
        if leadership is not None:
            leadership.release()
    return 0
