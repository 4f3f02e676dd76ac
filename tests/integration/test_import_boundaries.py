"""Import boundaries: what each `kvfence` subcommand loads, and the import contracts of
`make lint` (pyproject [tool.importlinter]) catching a wrong-way import.

Already tested elsewhere, not repeated here: `kvfence crd` and `kvfence operator --help` with
torch unimportable (test_dockerfiles.py), the router without torch (test_dockerfiles.py), the
canary without torch (test_canary_checks.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.commands import kvfence_subcommands, run_without_torch

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "cli/kvfence_cli",
    "engine/kvfence_engine",
    "operator/kvfence_operator",
    "devcluster/kvfence_devcluster",
)


@pytest.mark.parametrize("command", sorted(kvfence_subcommands()))
def test_a_subcommands_help_loads_neither_torch_nor_the_operators_kopf(command: str) -> None:
    """Each subcommand imports its dependencies when it runs: `kvfence serve --help` needs no
    kopf (the engine image's commands never start the operator), `kvfence operator --help` no
    torch (the operator image has none)."""
    result = run_without_torch(
        f"""
        try:
            main([{command!r}, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        else:
            raise AssertionError("--help returned instead of exiting")
        loaded = sorted({{"torch", "kopf", "kubernetes"}} & set(sys.modules))
        assert not loaded, f"`kvfence {command} --help` loaded {{loaded}}"
        """
    )
    assert result.returncode == 0, result.stderr
    assert f"kvfence {command}" in result.stdout


def copy_packages(tree: Path) -> Path:
    """The four packages and pyproject.toml (which holds the contracts) under tree."""
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` as `make lint` runs it, on the packages under tree."""
    run = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"
    return subprocess.run(
        [sys.executable, "-c", run, "--no-cache", "--no-logo"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tree,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                str(tree / d) for d in ("cli", "engine", "operator", "devcluster")
            ),
        },
    )


def test_the_packages_keep_every_import_contract(tmp_path: Path) -> None:
    result = lint_imports(copy_packages(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken." in result.stdout, result.stdout


# (module that gains the import, the import, what import-linter must say)
WRONG_WAY_IMPORTS = {
    "the engine imports the operator": (
        "engine/kvfence_engine/core/__init__.py",
        "import kvfence_operator.crd.types",
        "kvfence_engine is not allowed to import kvfence_operator",
    ),
    "the operator imports the CLI": (
        "operator/kvfence_operator/__init__.py",
        "from kvfence_cli import main",
        "kvfence_operator is not allowed to import kvfence_cli",
    ),
    "the operator imports numpy": (
        "operator/kvfence_operator/__init__.py",
        "import numpy",
        "kvfence_operator is not allowed to import numpy",
    ),
    "the router imports torch, even lazily": (
        "engine/kvfence_engine/router/__init__.py",
        "def _load():\n    import torch",
        "kvfence_engine.router is not allowed to import torch",
    ),
    "the core imports the serving layer": (
        "engine/kvfence_engine/core/__init__.py",
        "from kvfence_engine.serving import app",
        "kvfence_engine.core is not allowed to import kvfence_engine.serving",
    ),
    "serving imports the router": (
        "engine/kvfence_engine/serving/__init__.py",
        "from kvfence_engine.router import app",
        "kvfence_engine.serving is not allowed to import kvfence_engine.router",
    ),
    "the router imports the engine": (
        "engine/kvfence_engine/router/__init__.py",
        "from kvfence_engine.core import engine",
        "kvfence_engine.router is not allowed to import kvfence_engine.core.engine",
    ),
}


@pytest.mark.parametrize("case", WRONG_WAY_IMPORTS)
def test_the_import_contracts_fail_when(case: str, tmp_path: Path) -> None:
    """Negative control: the contracts are read and bite, one wrong-way import at a time."""
    module, statement, complaint = WRONG_WAY_IMPORTS[case]
    tree = copy_packages(tmp_path)
    with (tree / module).open("a") as f:
        f.write(f"\n{statement}\n")
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert complaint in result.stdout, result.stdout
