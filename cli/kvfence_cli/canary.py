"""`kvfence canary`: try to make tenant B see tenant A's data."""

import argparse
import logging
import sys
from dataclasses import replace

from kvfence_cli.common import (
    TARGET_HELP,
    Subparsers,
    positive,
    positive_rate,
    positive_seconds,
    read_token,
    server_url,
)

EPILOG = """\
example:
  kvfence canary --target 127.0.0.1:8000 --tenant-a-key KEY_A --tenant-b-key KEY_B

Against a local `kvfence up` (a target on 127.0.0.1 or localhost whose port that `up` serves,
found in its state folder, $KVFENCE_CACHE_DIR/up or ~/.cache/kvfence/up), the internal token
and the timeout default to that `up`'s own: its canary's run, by hand.

exit codes:
  0  pass: tenant B saw nothing of tenant A's
  1  fail: an isolation or status check failed (the report says which, and why)
  2  could not run: the target is unreachable, a key was refused, a check could not be
     performed (e.g. the engines' counters without the internal token), or a flag is wrong"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "canary",
        help="try to make tenant B see tenant A's data; exit 0 pass, 1 fail, 2 could not run",
        description="Try to make tenant B see tenant A's data through a running deployment: A "
        "fills the KV pool with marked prompts, B's prompts of boundary lengths read the pages "
        "A just released, and B's answers, lengths, latencies and the engines' isolation "
        "counters are judged (docs/canary.md). The operator runs it as a Job before a revision "
        "serves; `kvfence up` runs it before it says 'serving'.",
        epilog=EPILOG,
    )
    p.add_argument(
        "--target",
        type=server_url,
        required=True,
        metavar="URL",
        help=TARGET_HELP,
    )
    p.add_argument("--tenant-a-key", required=True, help="API key of the tenant who plants data")
    p.add_argument("--tenant-b-key", required=True, help="API key of the tenant who probes")
    p.add_argument(
        "--internal-token-file",
        default=None,
        metavar="FILE",
        help="the internal token, sent only to read the router's /metrics (the engines' "
        "isolation counters); without it that check cannot run against a router that has one "
        "(default: a local `kvfence up`'s, from its state folder)",
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
        "--timeout",
        type=positive_seconds,
        default=None,
        help="seconds for the whole run, then exit 2 (default: a local `kvfence up`'s "
        "spec.canary.timeoutSeconds, else 900, that field's default)",
    )
    p.add_argument(
        "--rounds", type=positive, default=3, help="rounds of pool pollution and probing"
    )
    p.add_argument(
        "--max-requests",
        type=positive,
        default=None,
        help="the run's budget of HTTP requests; spent, it stops and exits 2 (default: 1000)",
    )
    p.add_argument(
        "--rate",
        type=positive_rate,
        default=None,
        metavar="PER_SECOND",
        help="requests a second on average, a pollution burst at once (default: unbounded); "
        "the standing canary's bound on the load it adds to a serving revision",
    )
    p.set_defaults(func=run)


def local_up_defaults(args: argparse.Namespace) -> tuple[str | None, float]:
    """(internal token file, timeout) as given, else a local `kvfence up`'s when the target is
    its router (said in one line), else (None, the CRD's default). Looked up only when a flag
    was left out: an `up` of another state folder is not found, and needs the flags."""
    from kvfence_engine.canary.config import DEFAULT_TIMEOUT

    token_file, timeout = args.internal_token_file, args.timeout
    if token_file is not None and timeout is not None:
        return token_file, timeout
    from kvfence_operator.local.state import serving_at

    found = serving_at(args.target)
    if found is None:
        return token_file, timeout if timeout is not None else DEFAULT_TIMEOUT
    took = []
    if token_file is None:
        token_file = found.internal_token_file
        took.append(f"its internal token ({token_file})")
    if timeout is None:
        timeout = found.canary_timeout_seconds
        took.append(f"its canary's timeout ({timeout:g}s, spec.canary.timeoutSeconds)")
    print(
        f"canary: {args.target} is `kvfence up` {found.name} (revision {found.revision}, pid "
        f"{found.pid}): using {' and '.join(took)}",
        flush=True,
    )
    return token_file, timeout


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
    token_file, timeout = local_up_defaults(args)
    try:
        config = CanaryConfig(
            target=args.target,
            tenant_a_key=args.tenant_a_key,
            tenant_b_key=args.tenant_b_key,
            internal_token=read_token(token_file),
            context_length=args.context_length,
            timeout=timeout,
            rounds=args.rounds,
            rate=args.rate,
            **({} if args.max_requests is None else {"max_requests": args.max_requests}),
        )
    except (ValueError, OSError) as exc:  # a bad flag, or an unreadable token file
        print(f"kvfence canary: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    # made once the flags are good: an unfinished Progress is what this process reports
    with Progress("canary", len(planned_steps(args.rounds))) as progress:
        steps = replace(config, progress=progress.start_step, notice=progress.say)
        report = run_canary(steps)
    print(report.human())
    if args.report:
        write_report(report, args.report)
    write_termination_message(report, args.termination_log)
    return report.exit_code
