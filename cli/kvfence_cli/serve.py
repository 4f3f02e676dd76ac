"""`kvfence serve`: one engine process (combined, prefill or decode role)."""

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvfence_cli.common import (
    SIZES_HELP,
    Subparsers,
    add_drain_seconds,
    add_listen,
    add_metrics_token,
    add_request_limits,
    check_metrics_token,
    http_server,
    listen,
    positive,
    positive_seconds,
    read_token,
    run_http,
    share,
    size,
)
from kvfence_engine.core.faults import Fault
from kvfence_engine.core.pool_plan import (
    PREFIX_CACHE_IDLE_SECONDS,
    PREFIX_CACHE_SHARE,
    PREFIX_CACHE_TENANTS,
    check_cache_flags,
)
from kvfence_engine.preflight import WEIGHT_DTYPES

if TYPE_CHECKING:
    from kvfence_engine.parallel.launch import Ranks
    from kvfence_engine.serving.async_engine import AsyncEngine


def default_choice_cache() -> Path:
    """$XDG_CACHE_HOME/kvfence/weight-choice, or ~/.cache/kvfence/weight-choice."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvfence" / "weight-choice"


EPILOG = f"""\
examples:
  kvfence serve --model builtin:tiny-random --kv-cache-memory 4Mi --port 8001
  kvfence serve --model builtin:smollm2-135m-instruct --kv-cache-memory 256Mi --threads 2

{SIZES_HELP}

exit codes:
  1    the model could not load (the reason is the last stderr line and in --termination-log)
  2    a usage error, a port in use, an unusable --device, an unreadable
       --internal-token-file, or --unsafe-fault refused
  130  stopped by Ctrl-C (SIGINT)

SIGTERM (how Kubernetes stops a pod) ends it with 0, after the requests and streams in flight
finished or --drain-seconds passed."""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "serve",
        help="run an engine (combined, prefill or decode role)",
        description="Run one engine: load the model, size its KV pool from --kv-cache-memory "
        "(or --memory-fraction) and serve the OpenAI API (/v1/completions, /v1/chat/completions, "
        "/v1/models) with /healthz, /readyz and /v1/kvpool. The combined role is a whole server "
        "for one tenant; prefill and decode engines sit behind `kvfence router`, as the "
        "operator and `kvfence up` run them.",
        epilog=EPILOG,
    )
    # contracts.Role's values (a test pins them): importing it here would load pydantic
    p.add_argument(
        "--role",
        choices=["combined", "prefill", "decode"],
        default="combined",
        help="combined: prefill and decode here; prefill/decode: one half, behind a router",
    )
    p.add_argument(
        "--model",
        required=True,
        help="builtin:smollm2-135m-instruct, builtin:tiny-random, FILE.gguf or a folder",
    )
    add_listen(p, "HTTP port (OpenAI API, probes)")
    p.add_argument(
        "--transfer-port",
        type=int,
        default=8001,
        help="decode role: TCP port prefill streams KV to (0: any free port)",
    )
    p.add_argument(
        "--transfer-max-connections",
        type=positive,
        default=128,
        help="decode role: transfer connections served at once; more are refused "
        "(too_many_connections)",
    )
    p.add_argument(
        "--transfer-hello-timeout",
        type=positive_seconds,
        default=5.0,
        help="decode role: seconds a new transfer connection has to send its whole HELLO",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        help="require this token on internal endpoints, KV transfers, /v1/kvpool and /metrics "
        "(X-Kvfence-Internal-Token, or Authorization: Bearer for Prometheus)",
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
        type=positive,
        default=None,
        help="advertised context (default: the model's max positions)",
    )
    p.add_argument(
        "--context-policy",
        choices=["refuse", "lower"],
        default="refuse",
        help="refuse: advertise the context even when the pool is smaller (the operator's "
        "pool check decides); lower: serve what the pool holds, rounded down to a page",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--kv-cache-memory",
        type=size,
        default=None,
        help="KV pool budget in bytes, e.g. 512Mi (CPU default 512Mi)",
    )
    budget.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="KV pool budget as a fraction of free device memory",
    )
    p.add_argument("--page-size", type=positive, default=16, help="tokens per KV page")
    p.add_argument(
        "--revision", default="dev", help="the revision this engine reports (the operator's hash)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default="auto",
        help="auto: on CPU for a GGUF with Q4_0/Q4_1 tensors, int4 (its own 4-bit blocks, kept; "
        "other linears float16) or int4+float16 (int4 up to a few rows, float16 beyond: both "
        "held), whichever measures faster on this CPU at start; else float32 on CPU and "
        "bfloat16 on CUDA. On CPU int4, int4+float16, float16 and int8 pack the linear weights "
        "(fewer bytes per step) and compute in float32",
    )
    p.add_argument(
        "--weight-choice-cache",
        metavar="DIR",
        default=str(default_choice_cache()),
        help="where --weight-dtype auto keeps what it measured, by model, CPU, torch and "
        "threads: a later start of the same model on the same machine packs as measured "
        "without measuring again (default: %(default)s; '' measures at every start)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="dtype of the KV pool (auto: the model's compute dtype); a narrower one holds "
        "more tokens in the same --kv-cache-memory",
    )
    p.add_argument(
        "--max-num-seqs", type=positive, default=64, help="sequences decoded together per step"
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode's device kernels without capturing CUDA graphs",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=positive,
        default=4096,
        help="prompt tokens prefilled per step (longer prompts take several)",
    )
    p.add_argument(
        "--max-waiting",
        type=positive,
        default=512,
        help="queue length beyond which requests get 503 + Retry-After",
    )
    p.add_argument(
        "--max-pool-share-per-tenant",
        type=share,
        default=1.0,
        metavar="F",
        help="fraction of the KV pool (0 < F <= 1) one tenant's requests may reserve, each its "
        "prompt plus max_tokens; a request over it gets 429 tenant_pool_share + Retry-After "
        "(default 1.0: no cap). The combined role serves one tenant, 'default'",
    )
    add_request_limits(p)
    add_metrics_token(p)
    add_drain_seconds(p)
    p.add_argument("--scrub-on-free", action="store_true", help="zero pages when released")
    p.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="reuse the KV of a prompt's leading full pages for later requests of the same "
        "tenant (and cache_salt); combined and prefill roles (a no-op in decode, which computes "
        "no prompt). Off by default: a tenant's hits show in "
        "its own usage.cached_tokens and timing (docs/isolation.md)",
    )
    p.add_argument(
        "--prefix-cache-secret-file",
        default=None,
        metavar="FILE",
        help="the secret the prefix cache keys pages with (at least 16 bytes); default: "
        "random per process",
    )
    p.add_argument(
        "--prefix-cache-share",
        type=float,
        default=PREFIX_CACHE_SHARE,
        metavar="F",
        help="the share of the KV pool that is the prefix cache's (default %(default)s): no "
        "request's pages come from it, so what a tenant keeps cached never depends on what "
        "others send (docs/isolation.md)",
    )
    p.add_argument(
        "--prefix-cache-tenants",
        type=positive,
        default=None,
        metavar="N",
        help="tenants that may hold cached pages at once, each up to share/N of the pool, "
        f"evicting only its own (default {PREFIX_CACHE_TENANTS}; 1 in the combined role, which "
        "serves one tenant)",
    )
    p.add_argument(
        "--prefix-cache-idle-seconds",
        type=positive_seconds,
        default=PREFIX_CACHE_IDLE_SECONDS,
        metavar="S",
        help="a cached page no request used for S seconds leaves the cache; a tenant with "
        "none left gives its slot back (default %(default)s)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=positive,
        default=1,
        metavar="N",
        help="split the model over N ranks (N GPUs from --device, or N processes on CPU); "
        "this process is rank 0 and starts the others (default %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="torch CPU threads, per rank (default: the cores shared among the ranks)",
    )
    p.add_argument(
        "--termination-log",
        default=None,
        metavar="FILE",
        help="when the engine cannot start, also write why to FILE (the operator gives "
        "Kubernetes' /dev/termination-log); the reason is always the last line on stderr",
    )
    p.add_argument(
        "--unsafe-fault",
        action="append",
        default=[],
        choices=sorted(fault.value for fault in Fault),
        metavar="NAME",
        help="TEST ONLY; refused unless KVFENCE_ALLOW_UNSAFE=1",
    )
    p.set_defaults(func=run)


def check_prefix_cache(args: argparse.Namespace) -> None:
    """Refuse, before anything loads, a prefix cache the role cannot have or an unusable
    secret file (ValueError or OSError: a usage error)."""
    if args.prefix_cache_secret_file is not None and not args.prefix_cache:
        raise ValueError("--prefix-cache-secret-file needs --prefix-cache")
    if not args.prefix_cache:
        return
    check_cache_flags(
        args.prefix_cache_share, args.prefix_cache_tenants or 1, args.prefix_cache_idle_seconds
    )
    if args.prefix_cache_secret_file is not None:
        from pathlib import Path

        from kvfence_engine.core.prefix_cache import PrefixKeys

        PrefixKeys.from_file(Path(args.prefix_cache_secret_file), args.page_size)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvfence_engine.contracts import Role
    from kvfence_engine.core.device import resolve_device
    from kvfence_engine.core.engine import EngineArgs, LLMEngine
    from kvfence_engine.core.faults import Faults, UnsafeFaultRefused
    from kvfence_engine.core.metrics import EngineMetrics
    from kvfence_engine.core.pool_plan import ContextPolicy
    from kvfence_engine.core.shards import plan_shards
    from kvfence_engine.loading.loader import plan_load
    from kvfence_engine.parallel.launch import Ranks, check_devices, rank_threads, start_ranks
    from kvfence_engine.serving.app import create_app
    from kvfence_engine.serving.async_engine import AsyncEngine
    from kvfence_engine.serving.limits import set_request_limits
    from kvfence_engine.serving.state import ServerState
    from kvfence_engine.tools.localproc import free_port
    from kvfence_engine.tools.progress import Progress

    # Everything that can be checked before the loader thread starts: after it, an exit
    # tears down torch's threads mid-work (`terminate called without an active exception`).
    try:
        faults = Faults.from_names(args.unsafe_fault)
        token = read_token(args.internal_token_file)
        metrics_token = check_metrics_token(args.metrics_token_sha256, token)
        resolve_device(args.device)
        check_prefix_cache(args)
        sock = listen(args)
    except (UnsafeFaultRefused, OSError, ValueError) as exc:
        print(f"kvfence serve: {exc}", file=sys.stderr)
        return 2
    world = args.tensor_parallel_size
    if args.threads or world > 1:
        torch.set_num_threads(rank_threads(args.threads, world))
    role = Role(args.role)
    engine_args = EngineArgs(
        role=role,
        page_size=args.page_size,
        kv_cache_memory=args.kv_cache_memory,
        memory_fraction=args.memory_fraction,
        context_length=args.context_length,
        context_policy=ContextPolicy(args.context_policy),
        device=args.device,
        weight_dtype=args.weight_dtype,
        weight_choice_cache=args.weight_choice_cache or None,
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        max_batched_tokens=args.max_batched_tokens,
        max_waiting=args.max_waiting,
        scrub_on_free=args.scrub_on_free,
        revision=args.revision,
        transfer_port=args.transfer_port,
        reserve_timeout=args.reserve_timeout,
        max_pool_share_per_tenant=args.max_pool_share_per_tenant,
        kv_checksum=args.kv_checksum,
        prefix_cache=args.prefix_cache,
        prefix_cache_secret_file=args.prefix_cache_secret_file,
        prefix_cache_share=args.prefix_cache_share,
        prefix_cache_tenants=args.prefix_cache_tenants,
        prefix_cache_idle_seconds=args.prefix_cache_idle_seconds,
        faults=faults,
    )
    if faults.enabled:
        logging.warning("UNSAFE FAULTS ENABLED: %s (test only)", ", ".join(sorted(faults.enabled)))

    def build(metrics: EngineMetrics) -> AsyncEngine:
        """The load's named steps, then the model built and its pool allocated: a step each
        on /readyz and a line in the log, so that no part of a start is a silence. Lines even
        on a terminal: uvicorn's own log lines, written past tools/progress.say, would land
        in a bar (a GGUF conversion, the long step, is still a bar there)."""
        plan = plan_load(args.model)
        with Progress(
            f"loading {args.model}",
            len(plan.steps) + 1 + (world > 1),
            stream=sys.stderr,
            write=logging.getLogger("kvfence_engine.loading").info,
            bar=False,
        ) as loading:
            loaded = plan.run(loading.start_step)
            group = None
            if world > 1:
                plan_shards(loaded.config, world)  # a model that does not split: refused here
                check_devices(args.device, world)
                loading.start_step(f"starting ranks 1..{world - 1}, each loading its part")
                ranks.append(start_ranks(world, args.model, engine_args, free_port(), args.threads))
                ranks[0].watch(rank_died)
                group = ranks[0].join_as_rank0(args.device)
            loading.start_step(f"building the model on {args.device} and allocating its KV pool")
            return AsyncEngine(LLMEngine(loaded, engine_args, metrics, group=group))

    ranks: list[Ranks] = []  # ranks 1..N-1, once started

    def rank_died(rank: int, code: int | None) -> None:
        """A group short of a rank computes no step: end the engine, so that it restarts."""
        reason = (
            f"rank {rank} of {world} ended (exit code {code}); the engine cannot run without it"
        )
        logging.error("%s: exiting", reason)
        if args.termination_log:
            with contextlib.suppress(OSError), open(args.termination_log, "w") as f:
                f.write(reason + "\n")
        logging.shutdown()
        os._exit(1)

    state = ServerState(role=role, internal_token=token, metrics_token_sha256=metrics_token)
    app = create_app(state)
    set_request_limits(app, args.max_request_bytes, args.client_body_timeout)
    if role in (Role.PREFILL, Role.DECODE):
        from kvfence_engine.disagg.internal_api import internal_router

        # decode: also starts the KV receiver once the engine is loaded
        router = internal_router(
            state,
            transfer_host=args.host,
            transfer_port=args.transfer_port,
            transfer_max_connections=args.transfer_max_connections,
            transfer_hello_timeout=args.transfer_hello_timeout,
        )
        app.include_router(router)
    server = http_server(app, args)

    def stop(error: str) -> None:
        server.should_exit = True  # uvicorn's own way out: its main loop checks this flag

    state.load_in_background(build, on_failure=stop)
    code = run_http(server, sock)
    if ranks:
        end_ranks(state.engine, ranks[0])
    if state.engine is None and state.load_error is None:
        # stopped while the weights load: interpreter teardown under the loader's torch
        # threads aborts (`terminate called without an active exception`); skip it
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    if state.load_error is None:
        return code
    # A pod that cannot load its model must crash with the reason (a crash loop with a
    # termination message), not run without ever becoming ready.
    reason = f"engine failed to start: {state.load_error}"
    if args.termination_log:
        with contextlib.suppress(OSError), open(args.termination_log, "w") as f:
            f.write(reason + "\n")
    print(f"kvfence serve: {reason}", file=sys.stderr, flush=True)
    return 1


def end_ranks(engine: "AsyncEngine | None", ranks: "Ranks") -> None:
    """After the server stopped: the engine's loop ends its step, rank 0 ends the group, and
    the other ranks exit."""
    leader = None
    if engine is not None:
        engine.stop()
        leader = engine.engine.leader
    ranks.stop(leader.stop if leader is not None else lambda: None)
