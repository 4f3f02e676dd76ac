"""`kvfence crd`: print the InferenceDeployment CRD YAML (what crds/ holds)."""

import argparse
import sys

from kvfence_cli.common import Subparsers


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("crd", help="print the InferenceDeployment CRD YAML (what crds/ holds)")
    p.set_defaults(func=run)


def run(_: argparse.Namespace) -> int:
    from kvfence_operator.crd.schema import render_crd_yaml

    sys.stdout.write(render_crd_yaml())
    return 0
