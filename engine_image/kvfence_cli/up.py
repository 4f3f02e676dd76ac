"""`kvfence up`: an InferenceDeployment manifest as local processes."""

import argparse
import os
from pathlib import Path

from kvfence_cli.common import Subparsers

DEFAULT_LOCAL_KEY = "kvfence-local"


EPILOG = """\
examples:
  kvfence up examples/smollm2-local.yaml
  kvfence up examples/lower-context.yaml --port 9000 --api-key my-key

exit codes:
  0  it served, then was stopped (Ctrl-C or SIGTERM)
  1  not served: the pool check or the canary refused the revision (the output says why)
  2  a manifest that is not valid, or a process that could not start"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "up",
        help="run an InferenceDeployment manifest on this machine",
        description="Run an InferenceDeployment manifest on this machine as local processes: "
        "the engines and router the operator would start, the same pool check, the canary and "
        "the status table; then serve the OpenAI API until Ctrl-C. Logs, credentials and the "
        "canary cache live in --state-dir.",
        epilog=EPILOG,
    )
    p.add_argument(
        "manifest", type=Path, metavar="FILE.yaml", help="an InferenceDeployment (examples/*.yaml)"
    )
    p.add_argument("--port", type=int, default=8000, help="the router's (OpenAI API) port")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVFENCE_API_KEY", DEFAULT_LOCAL_KEY),
        help=f"key for the local tenant (default ${{KVFENCE_API_KEY}} or {DEFAULT_LOCAL_KEY})",
    )
    p.add_argument("--device", default="cpu", help="where the engines run: cpu, cuda or cuda:N")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="logs, credentials, canary cache (default: up/ in $KVFENCE_CACHE_DIR, else "
        "~/.cache/kvfence)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence_operator.up import run_up

    return run_up(args)
