"""The `kvfence` entry point: serve, router, canary, crd, operator, up, preflight."""

import logging
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from kvfence_cli import canary, crd, operator, preflight, router, serve, up
from kvfence_cli.common import Parser

DESCRIPTION = """\
kvfence: LLM serving for many tenants whose KV cache pages cannot leak between them.
Run a manifest on this machine with `kvfence up`, check a KV budget with `kvfence
preflight`, or run the parts a cluster runs (serve, router, canary, operator, crd)."""

EPILOG = """\
examples:
  kvfence up examples/smollm2-local.yaml     # run a manifest here: canary first, then serve
  kvfence preflight --model builtin:tiny-random --kv-cache-memory 4Mi --context-length 512
  kvfence COMMAND --help                     # its options, defaults, examples and exit codes

exit codes: 0 success and 2 a usage error, for every command; each command's --help lists
its others. `kvfence` alone prints this help and exits 0, as kubectl does."""


def _version() -> str:
    try:
        return version("kvfence")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def build_parser() -> Parser:
    parser = Parser(prog="kvfence", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvfence {_version()}",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for command in (up, preflight, serve, router, canary, operator, crd):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
