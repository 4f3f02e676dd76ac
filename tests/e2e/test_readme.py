"""The README documents what users touch: every field of the CRD and both of its commands."""

from pathlib import Path

import yaml

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


def spec_fields(node: dict, path: str) -> list[str]:
    props = node.get("properties") or {}
    if not props or path.endswith((".pod", ".resources", ".volume")):
        return [path]
    return [leaf for name, child in props.items() for leaf in spec_fields(child, f"{path}.{name}")]


def test_the_crd_reference_names_every_spec_field():
    crd = yaml.safe_load((ROOT / "crds" / "inferencedeployment.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    fields = spec_fields(schema, "spec")
    assert len(fields) > 25
    missing = [f for f in fields if f"`{f}`" not in README]
    assert not missing, f"README's CRD reference lacks {missing}"


def test_the_quickstart_gives_the_two_commands_the_makefile_runs():
    makefile = (ROOT / "Makefile").read_text()
    for command in ("make up", "make test"):
        assert command in README
        assert f"\n{command.split()[1]}: setup" in makefile
    assert "kvfence up examples/smollm2-local.yaml" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()
