"""`kvfence crd`: print the InferenceDeployment CRD YAML (what crds/ holds)."""

import argparse
import sys

from kvfence_cli.common import Subparsers

EPILOG = """\
example:
  kvfence crd | kubectl apply -f -

exit codes:
  0  printed"""


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "crd",
        help="print the InferenceDeployment CRD YAML (what crds/ holds)",
        description="Print the InferenceDeployment CustomResourceDefinition: generated from the "
        "operator's models, exactly what crds/ and the chart hold. Apply it before the operator "
        "starts.",
        epilog=EPILOG,
    )
    p.set_defaults(func=run)


def run(_: argparse.Namespace) -> int:
    from kvfence_operator.crd.schema import render_crd_yaml

    sys.stdout.write(render_crd_yaml())
    return 0
