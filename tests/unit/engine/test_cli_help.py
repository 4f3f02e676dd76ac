"""`kvfence <command> --help` teaches: what the command is for, an example to copy, what each
option does and its default, and what the exit code means (issue 18, item 8)."""

import argparse

import pytest

from helpers.commands import kvfence_subcommands
from kvfence_cli.common import TARGET_HELP
from kvfence_cli.main import build_parser


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subparsers.choices[name]


def _shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text of one option as --help prints it (defaults expanded)."""
    formatter = parser._get_formatter()
    return formatter._expand_help(action)


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", sorted(kvfence_subcommands()))
def test_each_subcommand_says_what_it_is_for_with_an_example_and_its_exit_codes(name):
    parser = _subparser(name)
    assert parser.description and len(parser.description) > 40, f"`kvfence {name}` says little"
    epilog = parser.epilog or ""
    assert f"  kvfence {name}" in epilog.split("example", 1)[-1], f"`kvfence {name}`: no example"
    assert "exit codes:" in epilog, f"`kvfence {name}` does not list its exit codes"
    assert "exit codes:" in parser.format_help()  # printed as written, not re-wrapped away


@pytest.mark.parametrize("name", sorted(kvfence_subcommands()))
def test_every_option_is_explained_and_shows_its_default(name):
    parser = _subparser(name)
    for action in _options(parser):
        flag = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"kvfence {name} {flag}: no help"
        shown = _shown_help(parser, action)
        takes_a_value = action.nargs != 0
        if takes_a_value and action.default not in (None, [], argparse.SUPPRESS):
            assert "default" in shown, f"kvfence {name} {flag}: default {action.default!r} unsaid"


def test_the_top_level_help_lists_every_subcommand_with_what_it_does():
    text = build_parser().format_help()
    for name in kvfence_subcommands():
        assert f"    {name}" in text
    assert "--version" in text
    assert "exit codes:" in text


def test_target_means_a_running_kvfence_server_in_every_subcommand():
    """It was a router's URL in `canary` and an engine's in `preflight`."""
    targets = {}
    for name in kvfence_subcommands():
        for action in _options(_subparser(name)):
            if "--target" in action.option_strings:
                targets[name] = action
    assert set(targets) == {"canary", "preflight"}
    for name, action in targets.items():
        assert action.help is not None and action.help.startswith(TARGET_HELP), name
        assert callable(action.type), name
        assert action.type("127.0.0.1:8000/v1/") == "http://127.0.0.1:8000", name
