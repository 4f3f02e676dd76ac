"""`kvfence preflight`: does the KV pool hold the context? (no GPU needed)"""

import argparse
import logging
import os
import sys

from kvfence_cli.common import (
    Subparsers,
    device,
    positive,
    positive_size,
    read_token,
    server_url,
)
from kvfence_engine.tools.preflight import KV_DTYPES, WEIGHT_DTYPES


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("preflight", help="does the KV pool hold the context? (no GPU needed)")
    p.add_argument("--model", help="builtin:..., a .gguf file or a folder (for the estimate)")
    p.add_argument("--kv-cache-memory", type=positive_size, help="pool budget, e.g. 512Mi")
    p.add_argument("--context-length", type=positive, required=True)
    p.add_argument("--page-size", type=positive, default=16)
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto")
    p.add_argument("--device", type=device, default="cpu")
    p.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default=None)
    p.add_argument(
        "--target", type=server_url, help="a running engine: read its live /v1/kvpool too"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVFENCE_API_KEY") or None,
        help="a tenant's key, for a --target router that has API keys",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        metavar="FILE",
        help="the target's internal token (an engine started with one requires it on /v1/kvpool)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence_engine.tools.preflight import run_preflight

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        args.internal_token = read_token(args.internal_token_file)
    except (ValueError, OSError) as exc:
        print(f"kvfence preflight: {exc}", file=sys.stderr)
        return 2
    return run_preflight(args)
