"""Argument types and helpers that more than one subcommand uses."""

import argparse
from typing import TYPE_CHECKING

from kvfence_engine.tools.units import parse_size

if TYPE_CHECKING:  # the operator's subcommands import this module; its image has no starlette
    from starlette.types import ASGIApp

Subparsers = argparse._SubParsersAction


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
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


def serve_http(app: "ASGIApp", args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=5,
    )
    return 0
