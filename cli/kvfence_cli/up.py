"""`kvfence up`: an InferenceDeployment manifest as local processes."""

import argparse
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvfence_cli.common import Subparsers, positive

if TYPE_CHECKING:
    from kvfence_engine.core.model_config import ModelConfig

DEFAULT_LOCAL_KEY = "kvfence-local"


EPILOG = """\
examples:
  kvfence up examples/smollm2-local.yaml
  kvfence up examples/lower-context.yaml --port 9000 --api-key my-key
  kvfence up examples/smollm2-local.yaml --tenant sk-a-01234567=team-a --tenant sk-b-01234567=team-b

exit codes:
  1    not served: the pool check or the canary refused the revision (the output says why)
  2    something to fix: a manifest that is not valid, a model, context or device the engines
       cannot use, a port in use, another `up` of this manifest running, or a process that
       could not start or died (its error and log are quoted)
  130  stopped by Ctrl-C (SIGINT); 143 stopped by SIGTERM"""


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
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="the router's (OpenAI API) port (0: any free port, said in the serving line)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVFENCE_API_KEY"),
        help="key of the tenant named 'local' (default: $KVFENCE_API_KEY; without it "
        f"{DEFAULT_LOCAL_KEY}, unless --tenant or --api-keys names the tenants)",
    )
    p.add_argument(
        "--tenant",
        dest="tenants",
        action="append",
        type=tenant_entry,
        default=[],
        metavar="KEY=NAME",
        help="a tenant and its key, as many as you like (e.g. --tenant sk-a-01234567=team-a "
        "--tenant sk-b-01234567=team-b); names are 1 to 95 of A-Z a-z 0-9 _ . : -",
    )
    p.add_argument(
        "--api-keys",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a keys file of yours, 'KEY TENANT' a line (the format of `kvfence router "
        "--api-keys` and of the cluster's api-keys Secret); the router re-reads it when it changes",
    )
    p.add_argument("--device", default="cpu", help="where the engines run: cpu, cuda or cuda:N")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="logs, credentials, canary cache (default: up/ in $KVFENCE_CACHE_DIR, else "
        "~/.cache/kvfence)",
    )
    p.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="torch CPU threads per engine process (`kvfence serve --threads`; default: "
        "the manifest's CPU resources, else torch's own choice)",
    )
    p.set_defaults(func=run)


def tenant_entry(text: str) -> tuple[str, str]:
    """`KEY=NAME` as (key, name); the key may hold '=', a name may not. Checked in full, with
    the router's rules, before anything starts (kvfence_operator/local/tenants.py)."""
    key, sep, name = text.rpartition("=")
    if not sep or not key or not name:
        raise argparse.ArgumentTypeError("expected KEY=NAME, e.g. sk-a-0123456789=team-a")
    return key, name


def run(args: argparse.Namespace) -> int:
    from kvfence_operator.local.up import run_up

    if args.api_key is None and not args.tenants and not args.api_keys:
        args.api_key = DEFAULT_LOCAL_KEY  # a first `up` needs no flag to be called
    return run_up(args, check_engines=engine_start_problem, estimate_pool=engine_pool)


@functools.lru_cache(maxsize=4)
def model_config(source: str) -> "ModelConfig":
    """The model's metadata, read once for all the checks before start (the source check
    and each engine's pool): before a GGUF's first conversion that is its header, which holds
    the whole vocabulary and takes seconds to parse."""
    from kvfence_engine.loading.config import load_config

    return load_config(source)


def engine_start_problem(source: str, context_length: int, device: str) -> str | None:
    """What would stop the engines from starting, found with their own code before any
    starts: a model source that does not resolve, a context beyond the model's positions
    (preflight's rule), a device this machine does not have. Here, not in the operator
    package: it may not import the engine's dependencies."""
    from kvfence_engine.preflight import positions_problem

    try:
        config = model_config(source)
    except (OSError, ValueError, KeyError) as exc:
        return f"spec.model.source: {exc}"
    problem = positions_problem(context_length, config.max_positions)
    if problem:
        return f"spec.contextLength: {problem}"
    if device != "cpu":  # torch takes seconds to import; cpu needs no check
        from kvfence_engine.core.device import resolve_device

        try:
            resolve_device(device)
        except ValueError as exc:
            return str(exc)
    return None


def engine_pool(argv: Sequence[str]) -> tuple[int, int] | None:
    """The pool a `kvfence serve` command line will allocate, (num_pages, page_size), by
    `kvfence preflight`'s arithmetic (the engine's own: pool_plan.plan_pool on the model's
    metadata, in the dtype `serve` resolves), read with `serve`'s own parser. None where
    only the engine can say: no --kv-cache-memory (a share of a device, or its default), a
    budget that holds no page (the engine says so, in its words), a line it would refuse."""
    from kvfence_cli import serve
    from kvfence_engine.core.pool_plan import plan_pool
    from kvfence_engine.preflight import DTYPE_BYTES, resolve_kv_dtype

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    serve.add_parser(parser.add_subparsers())
    try:
        args = parser.parse_args(list(argv))
    except (argparse.ArgumentError, SystemExit):
        return None
    if args.kv_cache_memory is None:
        return None
    try:
        dtype = resolve_kv_dtype(args.kv_cache_dtype, args.weight_dtype, args.device)
        plan = plan_pool(
            model_config(args.model),
            page_size=args.page_size,
            dtype_bytes=DTYPE_BYTES[dtype],
            budget_bytes=args.kv_cache_memory,
        )
    except (OSError, ValueError, KeyError):
        return None
    return plan.num_pages, plan.page_size
