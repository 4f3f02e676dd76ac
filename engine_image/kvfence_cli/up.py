"""`kvfence up`: an InferenceDeployment manifest as local processes."""

import argparse
import os
from pathlib import Path

from kvfence_cli.common import Subparsers

DEFAULT_LOCAL_KEY = "kvfence-local"


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("up", help="run an InferenceDeployment manifest on this machine")
    p.add_argument("manifest", type=Path, metavar="FILE.yaml")
    p.add_argument("--port", type=int, default=8000, help="the router's (OpenAI API) port")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVFENCE_API_KEY", DEFAULT_LOCAL_KEY),
        help=f"key for the local tenant (default ${{KVFENCE_API_KEY}} or {DEFAULT_LOCAL_KEY})",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--state-dir", type=Path, default=None, help="logs, credentials, canary cache")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence_operator.up import run_up

    return run_up(args)
