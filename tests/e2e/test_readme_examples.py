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

A marker of an unknown kind fails the test (a typo would otherwise silently check nothing), and
so does a kind no page uses any more.
"""

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfence_engine.tools.localproc import LocalProcess

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKED = re.compile(r"^<!-- checked: (.*?) -->\n```\w*\n(.*?)^```", re.M | re.S)
KINDS = {"shell", "openai-python"}
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
        server.wait_ready(timeout=300)  # the first start of a GGUF converts its weights
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
