"""Argument types and helpers that more than one subcommand uses."""

import argparse
import logging
import re
import signal
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvfence_engine.tools.units import parse_size

if TYPE_CHECKING:  # the operator's subcommands import this module; its image has no starlette
    import uvicorn
    from starlette.types import ASGIApp

Subparsers = argparse._SubParsersAction
SIZES_HELP = """\
sizes: bytes, or with a k/M/G/T (10^3, 10^6, 10^9, 10^12) or Ki/Mi/Gi/Ti (2^10, 2^20, 2^30,
  2^40) suffix, as a Kubernetes memory quantity: 512Mi (64MB and 64m are refused)"""
TARGET_HELP = (
    "a running kvfence server: a router, or one engine (e.g. http://127.0.0.1:8000; the "
    "http:// and a trailing /v1 may be left out)"
)


class HelpFormatter(argparse.HelpFormatter):
    """Text written on several lines (examples, exit codes) keeps its lines; a one-line
    paragraph is wrapped to the terminal. An option's help ends with its default, unless it
    says it itself or there is none (a flag, an unset value)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
            return text
        if "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """`kvfence` and each subcommand's parser (add_subparsers makes them of this class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_request_limits(parser: argparse.ArgumentParser) -> None:
    """The body cap and the client deadlines, nginx's names for the latter."""
    # kvfence_engine.serving.limits.DEFAULT_MAX_REQUEST_BYTES, DEFAULT_BODY_SECONDS and
    # serving.connections.HEADER_SECONDS (a test pins them equal); not imported: it would load
    # fastapi for every subcommand
    parser.add_argument(
        "--max-request-bytes",
        type=positive_size,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413 request_too_large before they are read (default 4Mi)",
    )
    parser.add_argument(
        "--client-header-timeout",
        type=positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="a connection whose request headers are not complete this long after it opened, "
        "or after its previous answer, is closed (default 10)",
    )
    parser.add_argument(
        "--client-body-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="a request body not complete this long after its headers gets 408 "
        "request_timeout (default 60)",
    )


def positive_size(text: str) -> int:
    value = size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _whole_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}")
    return value


def positive(text: str) -> int:
    return _whole_at_least(text, 1)


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
    return _whole_at_least(text, 0)


def _positive_number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be {what} > 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    return _positive_number(text, "a number of seconds")


def positive_rate(text: str) -> float:
    return _positive_number(text, "a number a second")


def device(text: str) -> str:
    """What torch.device takes for the engines kvfence runs: cpu, cuda or cuda:N."""
    kind, colon, index = text.partition(":")
    if text == "cpu" or (kind == "cuda" and (not colon or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")


def server_url(text: str) -> str:
    """A running kvfence server (router or engine) as people paste it: `127.0.0.1:8000`,
    `http://host:8000/` and `http://host:8000/v1` all mean `http://host:8000`."""
    url = text.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/").removesuffix("/v1").rstrip("/")
    try:
        parts = urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.query
        parts.port  # noqa: B018  (raises ValueError on a port that is not a number)
    except ValueError:
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(
            f"must be a kvfence server's URL, e.g. http://127.0.0.1:8000, got {text!r}"
        )
    return url


def read_token(path: str | None) -> str | None:
    """The shared internal token, from a file (a mounted Secret in Kubernetes)."""
    if path is None:
        return None
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"internal token file {path} is empty")
    return token


def sha256_hex(text: str) -> bytes:
    """A SHA-256 digest written as 64 hex digits, as bytes."""
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise argparse.ArgumentTypeError(f"must be 64 hex digits (a SHA-256), got {text!r}")
    return bytes.fromhex(text)


def add_metrics_token(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-token-sha256",
        type=sha256_hex,
        default=None,
        metavar="HEX",
        help="also accept on /metrics, and only there, the bearer token with this SHA-256 "
        "(Prometheus's: `printf %%s TOKEN | sha256sum`); needs --internal-token-file",
    )


def check_metrics_token(digest: bytes | None, internal_token: str | None) -> bytes | None:
    """The metrics token only narrows who may read a /metrics that the internal token already
    closes: without one, /metrics is open and a metrics token would mean nothing."""
    if digest is not None and internal_token is None:
        raise ValueError(
            "--metrics-token-sha256 needs --internal-token-file "
            "(without an internal token /metrics is open to everyone)"
        )
    return digest


PROBE_PATHS = ("/healthz", "/readyz")


class QuietProbes(logging.Filter):
    """Drop the access-log lines of health probes: a kubelet (or `kvfence up` waiting for a
    start) asks every few seconds, and the engine logs its own start and failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) > 2 and args[2] in PROBE_PATHS)


def add_listen(parser: argparse.ArgumentParser, port_help: str) -> None:
    """--host and --port, or --listen-fd: a socket a parent bound for this process."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (HTTP)")
    parser.add_argument("--port", type=int, default=8000, help=port_help)
    parser.add_argument(
        "--listen-fd",
        type=non_negative,
        metavar="FD",
        help="serve on this inherited TCP socket, already bound (its address replaces --host "
        "and --port): how a parent that chose a free port hands it over with no moment in "
        "which another process could take it (kvfence up does)",
    )


def listen(args: argparse.Namespace) -> socket.socket:
    """The HTTP socket, bound before anything else starts (weights, threads): a port in use
    is then one line and an exit, not uvicorn's bind error while a loader thread runs. Bound,
    not listening: connections are refused until `run_http` serves on it. From --listen-fd,
    the parent's socket; its address becomes args.host and args.port."""
    if args.listen_fd is not None:
        sock = inherited_socket(args.listen_fd)
        args.host, args.port = sock.getsockname()[:2]
        return sock
    host, port = args.host, args.port
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


def inherited_socket(fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise OSError(f"--listen-fd {fd}: not an open socket ({reason})") from None
    tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
    if not tcp or sock.getsockname()[1] == 0:
        sock.detach()  # not ours to close
        raise OSError(f"--listen-fd {fd}: not a bound TCP socket")
    return sock


DEFAULT_DRAIN_SECONDS = 5


def add_drain_seconds(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--drain-seconds",
        type=non_negative,
        default=DEFAULT_DRAIN_SECONDS,
        metavar="N",
        help="on SIGTERM, take no new connection and let the requests and streams in flight "
        "finish for up to N seconds, then exit 0 (the operator sets the pods' grace period "
        "less their preStop sleep)",
    )


def http_server(app: "ASGIApp", args: argparse.Namespace) -> "uvicorn.Server":
    import uvicorn

    from kvfence_engine.serving.connections import IDLE_SECONDS, with_header_deadline

    class DrainingServer(uvicorn.Server):
        """SIGTERM is how a pod is asked to stop: after the drain the process exits 0, as
        for a request, instead of uvicorn re-raising the signal (exit 143). Ctrl-C is still
        re-raised (130)."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                self._captured_signals.remove(sig)

    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=args.drain_seconds,
        timeout_keep_alive=int(IDLE_SECONDS),
        http=with_header_deadline(args.client_header_timeout),
    )
    return DrainingServer(config)


def run_http(server: "uvicorn.Server", sock: socket.socket) -> int:
    """Serve on `sock` (from `listen`) until stopped: 0 once stopped, by SIGTERM too (after
    draining: `http_server`); 130 for Ctrl-C, which uvicorn re-raises after its graceful
    shutdown (a traceback otherwise). uvicorn serves on the socket itself, never binding the
    port a second time, so there is no moment in which another process could take it."""
    host, port = sock.getsockname()[:2]
    logging.getLogger("kvfence").info("listening on http://%s:%d", host, port)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        return 130
    return 0


def serve_http(app: "ASGIApp", args: argparse.Namespace) -> int:
    """0 once stopped; 2 when the port cannot be had (one line on stderr)."""
    try:
        sock = listen(args)
    except OSError as exc:
        print(f"kvfence {args.command}: {exc}", file=sys.stderr)
        return 2
    return run_http(http_server(app, args), sock)
