"""What the Makefile runs, read with `make -n` (nothing is installed): torch comes from an
explicit, overridable index of CPU wheels (issue 34, item 10). Without one, pip on Linux takes
PyPI's torch, the multi-GB CUDA build; this machine got the CPU wheel only because its pip is
configured with a local one."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_install(tmp_path: Path, *overrides: str) -> str:
    """The line of `make setup` that installs torch, for a venv that does not exist yet."""
    dry = subprocess.run(
        ["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    [line] = [line for line in dry.splitlines() if '"torch==' in line]
    return line


def test_setup_installs_torch_from_the_cpu_index_by_default(tmp_path: Path) -> None:
    assert f'--index-url {CPU_INDEX} "torch==2.13.0"' in torch_install(tmp_path)


def test_the_torch_index_is_a_variable_to_override(tmp_path: Path) -> None:
    cuda = "https://download.pytorch.org/whl/cu128"
    assert f"--index-url {cuda} " in torch_install(tmp_path, f"TORCH_INDEX={cuda}")
    assert "--index-url" not in torch_install(tmp_path, "TORCH_INDEX=")  # pip's own config
