"""`kvfence router`: the OpenAI front of prefill + decode engines."""

import argparse
import logging
import sys
from pathlib import Path

from kvfence_cli.common import (
    Subparsers,
    add_drain_seconds,
    add_listen,
    add_metrics_token,
    add_request_limits,
    check_metrics_token,
    non_negative,
    positive,
    read_token,
    serve_http,
)

EPILOG = """\
example (engines started with `kvfence serve --role prefill|decode`):
  kvfence router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 \\
      --model builtin:tiny-random --api-keys keys.txt --port 8000

exit codes:
  2    a usage error, a port in use, or an unreadable keys, token or backends file
  130  stopped by Ctrl-C (SIGINT)

SIGTERM (how Kubernetes stops a pod) ends it with 0, after the requests and streams in flight
finished or --drain-seconds passed."""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "router",
        help="the OpenAI front of prefill + decode instances",
        description="The OpenAI front of prefill and decode engines: it checks each tenant's "
        "API key and limits, tokenizes, has a prefill engine compute the prompt's KV and "
        "stream it to a decode engine, and relays the answer. The operator and `kvfence up` "
        "run it in front of their engines.",
        epilog=EPILOG,
    )
    add_listen(p, "HTTP port (OpenAI API)")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill engine (repeatable)",
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="a decode engine (repeatable)"
    )
    p.add_argument(
        "--backends-file",
        default=None,
        help='JSON {"prefill": [URL], "decode": [URL], "contextLength": N}, re-read '
        "when it changes; the operator also pushes it (PUT /internal/v1/backends, internal "
        'token), and the newest "version" wins',
    )
    p.add_argument(
        "--api-keys",
        action="append",
        default=[],
        metavar="FILE",
        help="'KEY TENANT' per line, re-read when it changes; tenant names are 1 to 95 of "
        "A-Z a-z 0-9 _ . : -; without it every request is tenant 'default'",
    )
    p.add_argument(
        "--context-length",
        type=positive,
        default=None,
        help="served context (default: from the backends file or the decode pools)",
    )
    p.add_argument(
        "--max-concurrent-per-tenant",
        type=non_negative,
        default=0,
        metavar="N",
        help="requests one tenant may have in flight at once, from admission to the end of "
        "its answer; more get 429 tenant_limit + Retry-After (default 0: no limit, since a "
        "fair number depends on the deployment's capacity; the operator sets it from "
        "spec.tenantLimits.maxConcurrentRequests)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model source of the tokenizer and chat template (default: the one every engine "
        "reports in /v1/kvpool, waiting for them up to 120 s; the router refuses to start "
        "when they disagree, or disagree with --model)",
    )
    p.add_argument(
        "--tokenizer-from-engines",
        action="store_true",
        help="read the tokenizer from an engine of the backends (GET /internal/v1/tokenizer, "
        "internal token) instead of from the model's files, which this process then needs no "
        "access to; not ready until an engine (serving --model, if given) gave it",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        help="send this token to the engines; require it on /metrics and for the full "
        "/v1/kvpool (with API keys and no token, /metrics is off)",
    )
    p.add_argument(
        "--routing-secret-file",
        default=None,
        metavar="FILE",
        help="route prefix-aware: a tenant's prompts that begin alike go to the same prefill "
        "instance (for its --prefix-cache), by rendezvous hashing of the tenant and the "
        "prompt's first tokens keyed with this secret (at least 16 bytes; every router of a "
        "deployment needs the same), passing over down or overloaded instances; default: "
        "least-outstanding",
    )
    p.add_argument(
        "--routing-prefix-tokens",
        type=positive,
        default=None,
        metavar="N",
        help="with --routing-secret-file: how many leading prompt tokens place a request "
        "(default 64)",
    )
    add_request_limits(p)
    add_metrics_token(p)
    add_drain_seconds(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfence_engine.loading.tokenizer_source import load_tokenizer
    from kvfence_engine.router.app import create_router_app
    from kvfence_engine.router.backends import Backends
    from kvfence_engine.router.keys import ApiKeys
    from kvfence_engine.router.placement import DEFAULT_PREFIX_TOKENS, PrefixRouting
    from kvfence_engine.router.served_model import (
        MODEL_WAIT_SECONDS,
        RouterModel,
        agreed_model,
        read_engine_models,
    )
    from kvfence_engine.router.state import RouterState
    from kvfence_engine.router.tenants import TenantInflight
    from kvfence_engine.serving.limits import set_request_limits

    if not (args.prefill and args.decode) and not args.backends_file:
        print(
            "kvfence router: give --prefill and --decode URLs or --backends-file", file=sys.stderr
        )
        return 2
    if args.routing_prefix_tokens is not None and args.routing_secret_file is None:
        print(
            "kvfence router: --routing-prefix-tokens needs --routing-secret-file", file=sys.stderr
        )
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        token = read_token(args.internal_token_file)
        routing = (
            PrefixRouting.from_file(
                Path(args.routing_secret_file),
                args.routing_prefix_tokens or DEFAULT_PREFIX_TOKENS,
            )
            if args.routing_secret_file
            else None
        )
        metrics_token = check_metrics_token(args.metrics_token_sha256, token)
        keys = ApiKeys.load(args.api_keys)
        backends = Backends.create(args.prefill, args.decode, args.backends_file)
        engines = [b.url for pool in (backends.prefill, backends.decode) for b in pool.backends]
        wait = 0.0 if args.model else MODEL_WAIT_SECONDS  # given: check the engines that answer
        if args.tokenizer_from_engines:  # read once an engine is listed (RouterState)
            model = RouterModel(args.model or "", None)
            if args.model:  # the engines listed now must serve it
                agreed_model(engines, read_engine_models(engines, token, 0.0), args.model, 0.0)
            name, tokenizer = "", None
        else:
            model = agreed_model(
                engines, read_engine_models(engines, token, wait), args.model, wait
            )
            name, tokenizer = load_tokenizer(model.source)
    except (OSError, ValueError) as exc:
        print(f"kvfence router: {exc}", file=sys.stderr)
        return 2
    state = RouterState(
        backends.model_name or model.name or name,  # spec.model.name, else the engines' name
        tokenizer,
        backends,
        keys,
        token,
        args.context_length,
        inflight=TenantInflight(args.max_concurrent_per_tenant),
        tokenizer_from_engines=args.tokenizer_from_engines,
        tokenizer_source=args.model,
        routing=routing,
        metrics_token_sha256=metrics_token,
    )
    app = create_router_app(state)
    set_request_limits(app, args.max_request_bytes, args.client_body_timeout)
    return serve_http(app, args)
