"""The design is written down in docs/, and what it points at exists: every relative link and
anchor resolves, every module and function the docs name is in the tree, every flag and engine
metric docs/engine.md names is the real CLI's and the real registry's, and nothing cites the
design file that preceded docs/."""

import re
import subprocess
from functools import cache
from pathlib import Path

from helpers.markdown import github_anchors, prose

HERE = Path(__file__).resolve().parent
TOPLEVEL = ["git", "rev-parse", "--show-toplevel"]
ROOT = Path(
    subprocess.run(TOPLEVEL, cwd=HERE, check=True, capture_output=True, text=True).stdout.strip()
)
# "DESIGN" followed by ".md" or "section": a citation of the retired design file.
OLD_DESIGN_CITATION = re.compile(r"DESIGN(\.md|\s+section)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")
DOCS_REF_IN_CODE = re.compile(r"docs/[\w.-]+\.md(#[\w-]+)?")
# `kvfence_engine/core/isolation.py` or `kvfence_engine/core/isolation.py::check_reads`
CODE_REF = re.compile(r"`([\w./-]+\.py)(?:::([\w.]+))?`")


@cache
def repo_files(include_new: bool = True) -> tuple[str, ...]:
    """Tracked files, and with include_new the ones git does not ignore yet (so a reference to
    a file not yet committed resolves before the commit)."""
    new = ["--others", "--exclude-standard"] if include_new else []
    out = subprocess.run(
        ["git", "ls-files", "--cached", *new], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    return tuple(sorted(p for p in set(out.splitlines()) if (ROOT / p).is_file()))


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_exist_and_the_index_links_every_page():
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    expected = {"README.md", "architecture.md", "isolation.md", "transfer-protocol.md"}
    expected |= {"operator.md", "crd.md", "canary.md", "cluster.md", "local.md", "engine.md"}
    assert expected | {"benchmarks.md", "development.md"} <= pages
    index = (ROOT / "docs" / "README.md").read_text()
    unlinked = [page for page in sorted(pages - {"README.md"}) if f"]({page}" not in index]
    assert not unlinked, f"docs/README.md does not link {unlinked}"
    assert "](docs/" in (ROOT / "README.md").read_text(), "README.md does not link docs/"


def test_nothing_cites_the_retired_design_file():
    citing = []
    for path in repo_files(include_new=False):
        try:
            text = (ROOT / path).read_text()
        except UnicodeDecodeError:
            continue  # binary
        for number, line in enumerate(text.splitlines(), 1):
            if OLD_DESIGN_CITATION.search(line):
                citing.append(f"{path}:{number}: {line.strip()}")
    assert not citing, "cite docs/ instead:\n" + "\n".join(citing)


def test_every_relative_link_in_the_docs_and_readme_resolves():
    broken = []
    for md in markdown_files():
        for target in LINK.findall(prose(md.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(ROOT)}: ({target})"
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{where}: no such file")
            elif (
                anchor
                and resolved.suffix == ".md"
                and anchor not in github_anchors(resolved.read_text())
            ):
                broken.append(f"{where}: no heading with anchor #{anchor}")
    assert not broken, "\n".join(broken)


def test_every_docs_reference_in_the_code_resolves():
    broken = []
    for path in repo_files():
        if not path.endswith(".py"):
            continue
        for match in DOCS_REF_IN_CODE.finditer((ROOT / path).read_text()):
            page = ROOT / match.group(0).split("#")[0]
            anchor = (match.group(1) or "#")[1:]
            if not page.is_file():
                broken.append(f"{path}: {match.group(0)}: no such page")
            elif anchor and anchor not in github_anchors(page.read_text()):
                broken.append(f"{path}: {match.group(0)}: no such heading")
    assert not broken, "\n".join(broken)


def defines(source: str, name: str) -> bool:
    """A function, class or module-level constant named `name`; `Class.attr` needs both."""
    for part in name.split("."):
        pattern = rf"^\s*(?:async\s+def|def|class)\s+{part}\b|^{part}\s*[:=]"
        if not re.search(pattern, source, flags=re.M):
            return False
    return True


def test_every_module_and_function_the_docs_name_exists():
    """`path.py` must be a file of the tree (a path suffix is enough: a test named by its file
    name is found in whichever tier it lives); `path.py::name` must also define `name`."""
    missing = []
    for md in sorted((ROOT / "docs").glob("*.md")):
        for path, name in set(CODE_REF.findall(md.read_text())):
            files = [f for f in repo_files() if f == path or f.endswith("/" + path)]
            where = f"docs/{md.name}: `{path}{'::' + name if name else ''}`"
            if not files:
                missing.append(f"{where}: no such file")
            elif name and not any(defines((ROOT / f).read_text(), name) for f in files):
                missing.append(f"{where}: {name} is not defined there")
    assert not missing, "\n".join(missing)


ENGINE_PAGE = ROOT / "docs" / "engine.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def section(markdown: str, heading: str) -> str:
    """The text under `heading` (a whole heading line), up to the next heading of its level or
    higher."""
    level = heading.split(" ", 1)[0]
    body = markdown.split(f"\n{heading}\n", 1)[1]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", body, flags=re.M)]
    return body[: ends[0]] if ends else body


def cli_options(command: str) -> set[str]:
    """Every option string of `kvfence COMMAND`, from the real parser."""
    import argparse

    from kvfence_cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {opt for action in sub.choices[command]._actions for opt in action.option_strings}


def test_every_flag_the_engine_page_gives_is_a_flag_of_its_command():
    """docs/engine.md's `kvfence serve` table and its disaggregated commands name only flags
    that `kvfence serve` and `kvfence router` have."""
    text = ENGINE_PAGE.read_text()
    table = section(text, "## `kvfence serve`").split("\n### ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `--")]
    assert len(rows) > 10, "docs/engine.md has no `kvfence serve` flag table"
    unknown = [f"serve {flag}" for row in rows for flag in FLAG.findall(row)]
    unknown = [u for u in unknown if u.split()[1] not in cli_options("serve")]
    disagg = section(text, "## Disaggregated serving")
    block = re.search(r"```bash\n(.*?)```", disagg, flags=re.S)
    assert block, "docs/engine.md's Disaggregated serving shows no commands"
    commands = block.group(1).replace("\\\n", " ").splitlines()
    assert {c.split()[1] for c in commands} == {"serve", "router"}, commands
    for command in commands:
        name = command.split()[1]
        unknown += [f"{name} {f}" for f in FLAG.findall(command) if f not in cli_options(name)]
    assert not unknown, f"docs/engine.md names flags the CLI does not have: {unknown}"


def metric_names(text: str) -> list[str]:
    """The metric names in backticks: `a_{x,y}_total` is two names; a trailing `{label}` is
    labels, not part of the name."""
    names = []
    for raw in re.findall(r"`(kvfence_[\w{},]+)`", text):
        raw = re.sub(r"\{[^},]*\}$", "", raw)
        alternation = re.search(r"\{([^}]*)\}", raw)
        if alternation:
            names += [raw.replace(alternation.group(0), part) for part in alternation[1].split(",")]
        else:
            names.append(raw)
    return names


def test_every_engine_metric_the_endpoints_list_is_exported():
    """The `GET /metrics` item of docs/engine.md's Endpoints names only metrics an engine's
    registry (what its /metrics serves) has: family names, or their samples' names."""
    from kvfence_engine.core.metrics import EngineMetrics

    endpoints = section(ENGINE_PAGE.read_text(), "### Endpoints")
    item = next(i for i in endpoints.split("\n- ") if i.startswith("`GET /metrics`"))
    listed = metric_names(item)
    assert len(listed) > 10, item
    exported = set()
    for family in EngineMetrics().registry.collect():
        exported |= {family.name, f"{family.name}_total"} | {s.name for s in family.samples}
    missing = [name for name in listed if name not in exported]
    assert not missing, f"docs/engine.md lists metrics an engine does not export: {missing}"
