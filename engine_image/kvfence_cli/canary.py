"""`kvfence canary`: try to make tenant B see tenant A's data."""

import argparse
import logging
import sys

from kvfence_cli.common import Subparsers, positive, read_token


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "canary",
        help="try to make tenant B see tenant A's data; exit 0 pass, 1 fail, 2 could not run",
    )
    p.add_argument("--target", required=True, help="the router's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--tenant-a-key", required=True, help="API key of the tenant who plants data")
    p.add_argument("--tenant-b-key", required=True, help="API key of the tenant who probes")
    p.add_argument(
        "--internal-token-file",
        default=None,
        metavar="FILE",
        help="the internal token, sent only to read the router's /metrics (the engines' "
        "isolation counters); without it that check cannot run against a router that has one",
    )
    p.add_argument(
        "--context-length",
        type=positive,
        default=None,
        help="the served context to hold the target to (default: its max_model_len)",
    )
    p.add_argument(
        "--report",
        default=None,
        metavar="FILE",
        help="write the JSON report here",
    )
    p.add_argument(
        "--termination-log",
        default="/dev/termination-log",
        metavar="FILE",
        help="the one-line summary, if FILE exists and is writable (Kubernetes shows it as the "
        "pod's termination message)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds for the whole run (then exit 2)"
    )
    p.add_argument("--rounds", type=positive, default=3, help="rounds of pool pollution")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence_engine.canary import (
        EXIT_CANNOT_RUN,
        CanaryConfig,
        planned_steps,
        run_canary,
        write_report,
        write_termination_message,
    )
    from kvfence_engine.tools.progress import Progress

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    progress = Progress("canary", len(planned_steps(args.rounds)))
    try:
        config = CanaryConfig(
            target=args.target,
            tenant_a_key=args.tenant_a_key,
            tenant_b_key=args.tenant_b_key,
            internal_token=read_token(args.internal_token_file),
            context_length=args.context_length,
            timeout=args.timeout,
            rounds=args.rounds,
            progress=progress.start_step,
        )
    except (ValueError, OSError) as exc:  # a bad flag, or an unreadable token file
        print(f"kvfence canary: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    with progress:
        report = run_canary(config)
    print(report.human())
    if args.report:
        write_report(report, args.report)
    write_termination_message(report, args.termination_log)
    return report.exit_code
