"""The `kvfence` command as tests see it: its subcommands, and running code with torch blocked
(what the operator image and router pods have)."""

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

from kvfence_cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


def kvfence_subcommands() -> set[str]:
    parser = build_parser()
    (subparsers,) = [
        a
        for a in parser._actions
        if isinstance(a, argparse._SubParsersAction) and a.dest == "command"
    ]
    return set(subparsers.choices)


TORCH_BLOCKER = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is not in the operator image")
            return None

    sys.meta_path.insert(0, NoTorch())
    from kvfence_cli.main import main
    """
)


def run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", TORCH_BLOCKER + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
