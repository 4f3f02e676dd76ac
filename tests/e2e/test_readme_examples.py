"""The README's and the docs' examples run as shown: the commands they give print what they
say they print.

Which examples are checked is written in the page itself (README.md or a page under docs/), so
that whoever edits an example sees that it is checked, and an edit elsewhere never starts or
stops a check; a checked example keeps its check when it moves between pages. A checked
example is a fenced code block whose previous line is a marker, an HTML comment (invisible on
GitHub):

    <!-- checked: shell -->
        `$ kvfence ...` lines, each followed by what it prints. The test runs each command
        (as `python -m kvfence_cli ...`) and compares its standard output with the lines shown,
        exactly; the exit status is not compared (preflight's 1 means "does not fit").

    <!-- checked: openai-python SOURCE -->
        A Python snippet that talks to http://127.0.0.1:8000/v1 with the openai client. The
        test serves SOURCE (`kvfence serve --model SOURCE`, a combined engine, what `make serve`
        runs) on a free port, runs the snippet against it, and compares what the snippet
        prints with the `# comment` after each `print(...)`, line for line, exactly. So the
        model id, the fields and the answer shown are the real ones. Every such snippet sets
        `max_tokens` (without it a chat runs to the end of the context).

    <!-- checked: kvfence-up -->
        A local walkthrough: `kvfence up MANIFEST ...` first, then `kvfence ...` commands run
        beside it once it says `serving`, each of which must exit 0. Run as printed (flags
        and all, the state folder where `up` keeps it by default: under $KVFENCE_CACHE_DIR,
        here a fresh folder), with two substitutions that keep a shared test machine's work
        small and its ports free: the manifest runs `builtin:tiny-random` with a pool of the
        same number of tokens (`examples/`' SmolLM2 takes minutes to load on 2 cores), and
        port 8000 is a free port (`--port P` to `up`, `127.0.0.1:P` in the others).

A marker of an unknown kind fails the test (a typo would otherwise silently check nothing), and
so does a kind no page uses any more.
"""

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from helpers.waits import READY_S, GiveUp, eventually
from kvfence_engine.tools.localproc import LocalProcess, free_port

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKED = re.compile(r"^<!-- checked: (.*?) -->\n```\w*\n(.*?)^```", re.M | re.S)
KINDS = {"shell", "openai-python", "kvfence-up"}
SNIPPET_URL = "http://127.0.0.1:8000/v1"


@dataclass(frozen=True)
class Example:
    kind: str
    arg: str | None
    code: str
    page: str  # "README.md" or a page under docs/, for the failure message
    line: int

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.kind})"


def marked_examples() -> list[Example]:
    found = []
    for path in PAGES:
        text = path.read_text()
        for match in MARKED.finditer(text):
            kind, _, arg = match.group(1).strip().partition(" ")
            line = text.count("\n", 0, match.start()) + 1
            page = str(path.relative_to(ROOT))
            found.append(Example(kind, arg or None, match.group(2), page, line))
    return found


EXAMPLES = marked_examples()


def of_kind(kind: str) -> list[Example]:
    return [e for e in EXAMPLES if e.kind == kind]


def test_the_pages_mark_their_runnable_examples_with_known_kinds() -> None:
    assert {e.kind for e in EXAMPLES} == KINDS, [str(e) for e in EXAMPLES]


def test_the_readme_shows_a_checked_first_request() -> None:
    """The Quickstart's first request is one of the checked snippets, not a copy of one."""
    assert any(e.page == "README.md" and e.kind == "openai-python" for e in EXAMPLES), [
        str(e) for e in EXAMPLES
    ]


@pytest.mark.parametrize("example", of_kind("shell"), ids=str)
def test_a_shell_example_prints_what_its_page_shows(example: Example) -> None:
    commands: list[tuple[str, list[str]]] = []
    for text in example.code.splitlines():
        if text.startswith("$ "):
            commands.append((text[2:], []))
        else:
            assert commands, f"{example}: output before any `$ ` command: {text!r}"
            commands[-1][1].append(text)
    for command, shown in commands:
        program, *args = command.split()
        assert program == "kvfence", f"{example}: only kvfence commands are run: {command}"
        ran = subprocess.run(
            [sys.executable, "-m", "kvfence_cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert ran.stdout.splitlines() == shown, f"{example}: {command}\n{ran.stderr[-2000:]}"


def printed_lines(code: str) -> list[str]:
    """What the snippet says it prints: the `# comment` after each `print(...)`."""
    shown = []
    for text in code.splitlines():
        if text.lstrip().startswith("print("):
            assert "  # " in text, f"a print without the output it shows: {text!r}"
            shown.append(text.split("  # ", 1)[1])
    return shown


@pytest.mark.parametrize("example", of_kind("openai-python"), ids=str)
def test_an_openai_snippet_prints_what_its_page_shows(example: Example, tmp_path: Path) -> None:
    assert example.arg, f"{example}: the marker names no model source"
    assert SNIPPET_URL in example.code, f"{example}: the snippet does not use {SNIPPET_URL}"
    assert "max_tokens=" in example.code, f"{example}: set max_tokens"
    shown = printed_lines(example.code)
    assert shown, f"{example}: the snippet prints nothing to compare"
    args = ["serve", "--model", example.arg, "--kv-cache-memory", "256Mi", "--threads", "2"]
    server = LocalProcess(args, log_path=tmp_path / "serve.log").start()
    try:
        server.wait_ready(timeout=READY_S)  # the first start of a GGUF converts its weights
        ran = subprocess.run(
            [sys.executable, "-c", example.code.replace(SNIPPET_URL, server.url + "/v1")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.stop()
    assert ran.returncode == 0, f"{example}:\n{ran.stderr[-2000:]}"
    assert ran.stdout.splitlines() == shown, example


# What the walkthrough's manifest runs instead of its model: tiny-random's float32 KV takes 768
# bytes a token, so 540Ki holds the 720 tokens examples/smollm2-local.yaml's 32Mi holds.
WALKTHROUGH_MODEL = {"source": "builtin:tiny-random"}
WALKTHROUGH_POOL = "540Ki"
README_PORT = "8000"


def walkthrough_manifest(path: Path, into: Path) -> Path:
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["model"] = WALKTHROUGH_MODEL
    doc["spec"]["engine"]["kvCacheMemory"] = WALKTHROUGH_POOL
    into.write_text(yaml.safe_dump(doc))
    return into


@pytest.mark.parametrize("example", of_kind("kvfence-up"), ids=str)
def test_a_local_walkthrough_serves_and_its_commands_pass_beside_it(
    example: Example, tmp_path: Path
) -> None:
    """Issue 34: the README's canary command failed against the README's own deployment (no
    internal token, a timeout shorter than `up`'s), and `up` had one tenant. Here both run as
    the README prints them."""
    up, *beside = [line.split() for line in example.code.splitlines() if line.strip()]
    assert up[:2] == ["kvfence", "up"] and beside, f"{example}: `kvfence up` first, then others"
    assert all(c[0] == "kvfence" for c in beside), f"{example}: only kvfence commands are run"
    port = str(free_port())
    manifest = walkthrough_manifest(ROOT / up[2], tmp_path / Path(up[2]).name)
    assert "--port" not in up, f"{example}: the walkthrough serves on the default port"
    up_args = ["up", str(manifest), *up[3:], "--port", port]
    env = {**os.environ, "KVFENCE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "up.out"
    serving = subprocess.Popen(
        [sys.executable, "-m", "kvfence_cli", *up_args],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,  # noqa: SIM115
    )  # fmt: skip
    try:

        def said() -> str:
            text = log.read_text()
            if "serving: http" not in text and serving.poll() is not None:
                raise GiveUp(f"kvfence up exited {serving.returncode}:\n{text}")
            return text

        eventually(said, "kvfence up serving", 900, until=lambda t: "serving: http" in t)
        assert "(OpenAI API; 2 tenants: team-a, team-b)" in log.read_text()
        for command in beside:
            args = [a.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}") for a in command]
            ran = subprocess.run(
                [sys.executable, "-m", "kvfence_cli", *args[1:]],
                capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT,
            )  # fmt: skip
            assert ran.returncode == 0, f"{example}: {' '.join(command)}\n{ran.stdout}{ran.stderr}"
            if args[1] == "canary":
                assert "is `kvfence up` smollm2-local" in ran.stdout, ran.stdout
                assert ": PASS (exit 0)" in ran.stdout, ran.stdout
        serving.send_signal(signal.SIGINT)
        assert serving.wait(120) == 130, log.read_text()
        assert not list((tmp_path / "cache" / "up").glob("*/serving.json")), "removed at stop"
    finally:
        if serving.poll() is None:
            serving.kill()
            serving.wait()
