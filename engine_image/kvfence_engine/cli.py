"""The `kvfence` command. Subcommands import their heavy dependencies (torch) lazily."""

import argparse
import logging
import sys
from collections.abc import Sequence

from kvfence_operator.command import add_operator_command
from kvfence_operator.up import add_up_command

from .faults import FAULTS
from .preflight import add_preflight_command
from .units import parse_size


def read_token(path: str | None) -> str | None:
    """The shared internal token, from a file (a mounted Secret in Kubernetes)."""
    if path is None:
        return None
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"internal token file {path} is empty")
    return token


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run an engine (combined, prefill or decode role)")
    p.add_argument("--role", choices=["combined", "prefill", "decode"], default="combined")
    p.add_argument(
        "--model",
        required=True,
        help="builtin:smollm2-135m-instruct, builtin:tiny-random, FILE.gguf or a folder",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--transfer-port",
        type=int,
        default=8001,
        help="decode role: TCP port prefill streams KV to (0: any free port)",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        help="require this token on internal endpoints and KV transfers",
    )
    p.add_argument(
        "--no-kv-checksum",
        dest="kv_checksum",
        action="store_false",
        help="skip per-page checksums on KV transfers (prefill and decode must agree)",
    )
    p.add_argument(
        "--reserve-timeout",
        type=float,
        default=60.0,
        help="decode role: seconds a reservation may wait for its KV and first token",
    )
    p.add_argument(
        "--context-length",
        type=_positive,
        default=None,
        help="advertised context (default: the model's max positions)",
    )
    p.add_argument("--context-policy", choices=["refuse", "lower"], default="refuse")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--kv-cache-memory",
        type=_size,
        default=None,
        help="KV pool budget in bytes, e.g. 512Mi (CPU default 512Mi)",
    )
    budget.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="KV pool budget as a fraction of free device memory",
    )
    p.add_argument("--page-size", type=_positive, default=16)
    p.add_argument("--revision", default="dev")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--weight-dtype",
        choices=["float32", "bfloat16", "float16", "int8"],
        default=None,
        help="default float32 on CPU, bfloat16 on CUDA; on CPU float16 and int8 pack the "
        "linear weights (fewer bytes per step) and compute in float32",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="dtype of the KV pool (auto: the model's compute dtype); a narrower one holds "
        "more tokens in the same --kv-cache-memory",
    )
    p.add_argument("--max-num-seqs", type=_positive, default=64)
    p.add_argument("--max-batched-tokens", type=_positive, default=4096)
    p.add_argument(
        "--max-waiting",
        type=_positive,
        default=512,
        help="queue length beyond which requests get 503 + Retry-After",
    )
    p.add_argument("--scrub-on-free", action="store_true", help="zero pages when released")
    p.add_argument("--threads", type=_positive, default=None, help="torch CPU threads")
    p.add_argument(
        "--unsafe-fault",
        action="append",
        default=[],
        choices=sorted(FAULTS),
        metavar="NAME",
        help="TEST ONLY; refused unless KVFENCE_ALLOW_UNSAFE=1",
    )
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import torch

    from .async_engine import AsyncEngine
    from .engine import EngineArgs, LLMEngine
    from .faults import Faults, UnsafeFaultRefused
    from .metrics import EngineMetrics
    from .model_loader import load_model
    from .pool_plan import ContextPolicy
    from .server import ServerState, create_app

    try:
        faults = Faults.from_names(args.unsafe_fault)
        token = read_token(args.internal_token_file)
    except (UnsafeFaultRefused, OSError, ValueError) as exc:
        print(f"kvfence serve: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    engine_args = EngineArgs(
        role=args.role,
        page_size=args.page_size,
        kv_cache_memory=args.kv_cache_memory,
        memory_fraction=args.memory_fraction,
        context_length=args.context_length,
        context_policy=ContextPolicy(args.context_policy),
        device=args.device,
        weight_dtype=args.weight_dtype,
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        max_waiting=args.max_waiting,
        scrub_on_free=args.scrub_on_free,
        revision=args.revision,
        transfer_port=args.transfer_port,
        reserve_timeout=args.reserve_timeout,
        kv_checksum=args.kv_checksum,
        faults=faults,
    )
    if faults.enabled:
        logging.warning("UNSAFE FAULTS ENABLED: %s (test only)", ", ".join(sorted(faults.enabled)))

    def build(metrics: EngineMetrics) -> AsyncEngine:
        return AsyncEngine(LLMEngine(load_model(args.model), engine_args, metrics))

    state = ServerState(role=args.role, internal_token=token)
    if args.role == "decode":

        def start_receiver(engine: AsyncEngine) -> None:
            from .kv_receiver import KVReceiver

            receiver = KVReceiver(engine.engine, args.host, args.transfer_port, token)
            engine.engine.args.transfer_port = receiver.port
            receiver.start()

        state.on_ready.append(start_receiver)
    state.load_in_background(build)
    return _serve_http(create_app(state), args)


def _serve_http(app: object, args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="info",  # type: ignore[arg-type]
        timeout_graceful_shutdown=5,
    )
    return 0


def _add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="the OpenAI front of prefill + decode instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", default=[], metavar="URL")
    p.add_argument("--decode", action="append", default=[], metavar="URL")
    p.add_argument(
        "--backends-file",
        default=None,
        help='JSON {"prefill": [URL], "decode": [URL], "contextLength": N}, re-read '
        "when it changes",
    )
    p.add_argument(
        "--api-keys",
        action="append",
        default=[],
        metavar="FILE",
        help="'KEY TENANT' per line; without it every request is tenant 'default'",
    )
    p.add_argument(
        "--context-length",
        type=_positive,
        default=None,
        help="served context (default: from the backends file or the decode pools)",
    )
    p.add_argument(
        "--model",
        default="builtin:smollm2-135m-instruct",
        help="where the tokenizer and chat template come from",
    )
    p.add_argument("--internal-token-file", default=None)
    p.set_defaults(func=_router)


def _router(args: argparse.Namespace) -> int:
    from .backends import Backends
    from .router import RouterState, create_router_app, read_api_keys
    from .tokenizer_source import load_tokenizer

    if not (args.prefill and args.decode) and not args.backends_file:
        print(
            "kvfence router: give --prefill and --decode URLs or --backends-file", file=sys.stderr
        )
        return 2
    try:
        token = read_token(args.internal_token_file)
        keys = read_api_keys(args.api_keys)
        name, tokenizer = load_tokenizer(args.model)
        backends = Backends.create(args.prefill, args.decode, args.backends_file)
    except (OSError, ValueError) as exc:
        print(f"kvfence router: {exc}", file=sys.stderr)
        return 2
    state = RouterState(name, tokenizer, backends, keys, token, args.context_length)
    return _serve_http(create_router_app(state), args)


def _add_crd(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("crd", help="print the InferenceDeployment CRD YAML (what crds/ holds)")
    p.set_defaults(func=_crd)


def _crd(_: argparse.Namespace) -> int:
    from kvfence_operator.crd import render_crd_yaml

    sys.stdout.write(render_crd_yaml())
    return 0


def _add_canary(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "canary",
        help="try to make tenant B see tenant A's data; exit 0 pass, 1 fail, 2 could not run",
    )
    p.add_argument("--target", required=True, help="the router's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--tenant-a-key", required=True, help="API key of the tenant who plants data")
    p.add_argument("--tenant-b-key", required=True, help="API key of the tenant who probes")
    p.add_argument(
        "--context-length",
        type=_positive,
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
    p.add_argument("--rounds", type=_positive, default=3, help="rounds of pool pollution")
    p.set_defaults(func=_canary)


def _canary(args: argparse.Namespace) -> int:
    from .canary import (
        EXIT_CANNOT_RUN,
        CanaryConfig,
        run_canary,
        write_report,
        write_termination_message,
    )

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        config = CanaryConfig(
            target=args.target,
            tenant_a_key=args.tenant_a_key,
            tenant_b_key=args.tenant_b_key,
            context_length=args.context_length,
            timeout=args.timeout,
            rounds=args.rounds,
        )
    except ValueError as exc:
        print(f"kvfence canary: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    report = run_canary(config)
    print(report.human())
    if args.report:
        write_report(report, args.report)
    write_termination_message(report, args.termination_log)
    return report.exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfence", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_router(sub)
    _add_canary(sub)
    _add_crd(sub)
    add_operator_command(sub)
    add_up_command(sub)
    add_preflight_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
