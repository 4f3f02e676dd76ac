"""bench/vs_llamacpp.py without llama.cpp: its help comes from the project's own venv (it never
imports llama_cpp itself), and a missing llama-cpp-python venv is one clear line, not a
traceback. The benchmark proper needs a llama-cpp-python build (`make bench`); CI never has one."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "vs_llamacpp.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_help_without_llama_cpp_installed() -> None:
    assert importlib.util.find_spec("llama_cpp") is None  # the test path never has it
    done = run("--help")
    assert done.returncode == 0, done.stderr
    assert "--llamacpp-python" in done.stdout
    assert "--threads" in done.stdout


def test_a_missing_llamacpp_venv_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    done = run("--llamacpp-python", str(missing), "--rounds", "1")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines == [f"vs_llamacpp: no python at {missing}: {lines[0].split(': ', 2)[2]}"]
    assert "make bench" in lines[0]
    assert "Traceback" not in done.stderr


def test_a_python_without_llama_cpp_is_one_line() -> None:
    done = run("--llamacpp-python", sys.executable, "--rounds", "1")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"vs_llamacpp: {sys.executable} cannot import llama_cpp.server")
    assert "make bench" in lines[0]
