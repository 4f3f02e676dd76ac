"""Argument types and helpers that more than one subcommand uses."""

import argparse
import logging
import socket
import sys
from typing import TYPE_CHECKING

from kvfence_engine.tools.units import parse_size

if TYPE_CHECKING:  # the operator's subcommands import this module; its image has no starlette
    import uvicorn
    from starlette.types import ASGIApp

Subparsers = argparse._SubParsersAction


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_max_request_bytes(parser: argparse.ArgumentParser) -> None:
    # kvfence_engine.serving.limits.DEFAULT_MAX_REQUEST_BYTES (a test pins them equal); not
    # imported: it would load fastapi for every subcommand
    parser.add_argument(
        "--max-request-bytes",
        type=positive_size,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413 request_too_large before they are read (default 4Mi)",
    )


def positive_size(text: str) -> int:
    value = size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def share(text: str) -> float:
    """A fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def read_token(path: str | None) -> str | None:
    """The shared internal token, from a file (a mounted Secret in Kubernetes)."""
    if path is None:
        return None
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"internal token file {path} is empty")
    return token


PROBE_PATHS = ("/healthz", "/readyz")


class QuietProbes(logging.Filter):
    """Drop the access-log lines of health probes: a kubelet (or `kvfence up` waiting for a
    start) asks every few seconds, and the engine logs its own start and failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) > 2 and args[2] in PROBE_PATHS)


def listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before anything else starts (weights, threads): a port in use is
    then one line and an exit, not uvicorn's bind error while a loader thread runs."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        message = f"cannot listen on {host}:{port}: {reason.lower()} (choose another --port)"
        raise OSError(message) from None
    return sock


def http_server(app: "ASGIApp", args: argparse.Namespace) -> "uvicorn.Server":
    import uvicorn

    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5
    )
    return uvicorn.Server(config)


def run_http(server: "uvicorn.Server", sock: socket.socket) -> int:
    """0 once stopped; 130 for Ctrl-C, which uvicorn re-raises after its graceful shutdown
    (a traceback otherwise). SIGTERM ends the process by that signal, as uvicorn intends."""
    # uvicorn logs where it listens only for sockets it binds itself
    host, port = sock.getsockname()[:2]
    logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d", host, port)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        return 130
    return 0


def serve_http(app: "ASGIApp", args: argparse.Namespace) -> int:
    """0 once stopped; 2 when the port cannot be had (one line on stderr)."""
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        print(f"kvfence {args.command}: {exc}", file=sys.stderr)
        return 2
    return run_http(http_server(app, args), sock)
