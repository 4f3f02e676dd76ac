"""The `kvfence` entry point: serve, router, canary, crd, operator, up, preflight."""

import argparse
import logging
import sys
from collections.abc import Sequence

from kvfence_cli import canary, crd, operator, preflight, router, serve, up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfence",
        description="The `kvfence` command. Subcommands import their heavy dependencies "
        "(torch) lazily.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (serve, router, canary, crd, operator, up, preflight):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
