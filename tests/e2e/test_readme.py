"""The README is the front door: its Quickstart gives the two commands, it stays short, and the
reference it used to hold lives in docs/, where the CRD reference names every field of the CRD."""

import re
from pathlib import Path

import yaml

from helpers.images import INSTALL_STEPS

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
CRD_REFERENCE = ROOT / "docs" / "crd.md"  # its "Fields" table
README_MAX_LINES = 300


def spec_fields(node: dict, path: str) -> list[str]:
    props = node.get("properties") or {}
    if not props or path.endswith((".pod", ".resources", ".volume")):
        return [path]
    return [leaf for name, child in props.items() for leaf in spec_fields(child, f"{path}.{name}")]


def section(markdown: str, heading: str) -> str:
    """The text under `## heading`, up to the next heading of level 2 or higher."""
    return markdown.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_crd_reference_names_every_spec_field():
    crd = yaml.safe_load((ROOT / "crds" / "inferencedeployment.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    fields = spec_fields(schema, "spec")
    assert len(fields) > 25
    table = section(CRD_REFERENCE.read_text(), "Fields")
    missing = [f for f in fields if f"`{f}`" not in table]
    assert not missing, f"docs/crd.md's field table lacks {missing}"


def test_the_quickstart_gives_the_two_commands_the_makefile_runs():
    makefile = (ROOT / "Makefile").read_text()
    quickstart = section(README, "Quickstart")
    block = re.search(r"```bash\n(.*?)```", quickstart, flags=re.S)
    assert block, "the Quickstart has no bash block"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["make up", "make test"], commands
    for command in commands:
        assert f"\n{command.split()[1]}: setup" in makefile
    assert "kvfence up examples/smollm2-local.yaml" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_stays_a_front_door():
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference material "
        "into the docs/ page it belongs to and link it"
    )


def test_the_cluster_section_shows_the_steps_the_install_test_runs():
    """tests/images/test_install.py runs INSTALL_STEPS with the images; the README shows the
    same commands in the same order (comments aside), so what it tells a user was run."""
    block = section(README, "On a cluster").split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [
        line.split("  #", 1)[0].strip()
        for line in block.splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert commands == INSTALL_STEPS
