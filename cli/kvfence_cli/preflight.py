"""`kvfence preflight`: does the KV pool hold the context? (no GPU needed)"""

import argparse
import logging
import os
import sys

from kvfence_cli.common import (
    SIZES_HELP,
    TARGET_HELP,
    Subparsers,
    device,
    positive,
    positive_size,
    read_token,
    server_url,
)
from kvfence_engine.preflight import KV_DTYPES, WEIGHT_DTYPES

EPILOG = f"""\
examples:
  kvfence preflight --model builtin:smollm2-135m-instruct --kv-cache-memory 64Mi \\
      --context-length 2048
  kvfence preflight --target 127.0.0.1:8000 --api-key kvfence-local --context-length 2048

{SIZES_HELP}

exit codes:
  0  the context fits
  1  it does not fit (the last line says what LowerContext would serve, and the remedy)
  2  a usage error, nothing to check, or the target could not be read"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "preflight",
        help="does the KV pool hold the context? (no GPU needed)",
        description="Will the KV pool hold the context, before anything starts? From the "
        "model's metadata alone (no weights, no GPU) it runs the engine's own pool arithmetic "
        "for --kv-cache-memory; with --target it reads a running server's live /v1/kvpool too.",
        epilog=EPILOG,
    )
    p.add_argument(
        "--model",
        help="for the estimate: builtin:smollm2-135m-instruct, builtin:tiny-random, FILE.gguf "
        "or a folder, as `kvfence serve --model`",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=positive_size,
        metavar="SIZE",
        help="for the estimate: the pool budget per engine (spec.engine.kvCacheMemory), e.g. 512Mi",
    )
    p.add_argument(
        "--context-length",
        type=positive,
        required=True,
        metavar="TOKENS",
        help="the context to check (spec.contextLength); required",
    )
    p.add_argument("--page-size", type=positive, default=16, help="tokens per KV page")
    p.add_argument(
        "--tensor-parallel-size",
        type=positive,
        default=1,
        metavar="N",
        help="for the estimate: ranks per engine (spec.engine.tensorParallelSize); the budget "
        "is then each rank's, its pool the rank with the most KV heads' (default %(default)s)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="dtype of the pool; auto is the engine's compute dtype on --device (float32 on "
        "CPU, bfloat16 on CUDA), as `kvfence serve` resolves it",
    )
    p.add_argument(
        "--device",
        type=device,
        default="cpu",
        help="where the engine will run: cpu, cuda or cuda:N (resolves auto)",
    )
    p.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default="auto",
        help="as `kvfence serve --weight-dtype` (resolves auto; default auto: its KV dtype is "
        "float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--target", type=server_url, metavar="URL", help=f"{TARGET_HELP}: read its /v1/kvpool"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVFENCE_API_KEY") or None,
        help="a tenant's key, for a --target router that has API keys, as `kvfence up` "
        "prints it (default: $KVFENCE_API_KEY)",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        metavar="FILE",
        help="the target's internal token (an engine started with one requires it on /v1/kvpool)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence_engine.preflight import run_preflight

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        args.internal_token = read_token(args.internal_token_file)
    except (ValueError, OSError) as exc:
        print(f"kvfence preflight: {exc}", file=sys.stderr)
        return 2
    return run_preflight(args)
