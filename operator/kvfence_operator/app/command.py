"""`kvfence operator`: kopf underneath, with the options a Deployment needs."""

import argparse
import os
import sys

# how long a stopping leader waits for its running pass before it releases the Lease (within
# the chart's terminationGracePeriodSeconds)
STOP_WAIT_SECONDS = 20.0


def run_operator(args: argparse.Namespace) -> int:
    import logging

    import kopf

    from kvfence_operator.app import handlers  # noqa: F401  (registers the handlers)
    from kvfence_operator.app.handlers import OPERATOR_NAMESPACE_ENV
    from kvfence_operator.app.in_flight import PassesInFlight
    from kvfence_operator.app.metrics import operator_metrics, parse_metrics_url, serve_metrics
    from kvfence_operator.cluster.kube import NoClusterAccess, load_cluster_config
    from kvfence_operator.cluster.leader import Election, Leadership, Stopped, default_identity
    from kvfence_operator.cluster.metrics_token import SCRAPERS_ENV, scrapers_from

    try:  # before kopf, whose startup handler would retry it every 60 s with a traceback
        load_cluster_config()
        scrapers_from(os.environ.get(SCRAPERS_ENV))
        if args.metrics:
            parse_metrics_url(args.metrics)
    except (NoClusterAccess, ValueError) as exc:
        print(f"kvfence operator: {exc}", file=sys.stderr)
        return 2
    metrics = operator_metrics()
    if args.metrics:  # before the election: a standby answers too (no passes of its own)
        try:
            serve_metrics(metrics, args.metrics)
        except OSError as exc:
            print(f"kvfence operator: --metrics {args.metrics}: {exc}", file=sys.stderr)
            return 2
    if args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    else:  # the library logs every try of a standby at INFO; ours says what changes
        logging.getLogger("leaderelection").setLevel(logging.WARNING)
    in_flight = PassesInFlight()
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
            # the child caches watch the same namespaces; the handlers count passes in metrics
            memo=kopf.Memo(namespaces=args.namespace, metrics=metrics, in_flight=in_flight),
        )
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # kopf's login and startup errors: say what failed and exit
        print(f"kvfence operator: {exc}", file=sys.stderr)
        return 2
    finally:
        if leadership is not None:
            # the pass kopf left running in its thread pool ends before the next leader starts
            if not in_flight.idle(STOP_WAIT_SECONDS):
                logging.warning("a reconcile pass still runs after %g s", STOP_WAIT_SECONDS)
            leadership.release()
    return 0
