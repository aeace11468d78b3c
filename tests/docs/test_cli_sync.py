"""The command line's documentation follows its parser (``featurehooks.cli.build_parser()``): docs/cli.md's command
table and flag tables, the command counts of docs/cli.md, docs/index.md and the README's CLI summary, and every
``featurehooks COMMAND --flag`` written in README.md and docs/*.md. Every command and every flag of each command is
documented, and nothing is documented that does not exist. Cheap: the parser only, no model is built."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from featurehooks.cli import build_parser

from helpers import REPO

CLI = REPO / "docs" / "cli.md"
INDEX = REPO / "docs" / "index.md"
README = REPO / "README.md"
PAGES = (README, *sorted((REPO / "docs").glob("*.md")))
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")
FLAG = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")
HELP = {"-h", "--help"}


def _commands() -> dict[str, argparse.ArgumentParser]:
    found = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(found) == 1
    return dict(found[0].choices)


COMMANDS = _commands()


def flags(command: str) -> set[str]:
    """Every option string of ``command`` but ``-h``/``--help``."""
    return {flag for action in COMMANDS[command]._actions for flag in action.option_strings} - HELP


def number(word: str) -> int:
    return NUMBERS.index(word.lower())


def section(text: str, heading: str) -> str:
    """The text under the Markdown heading ``heading`` (any level), up to the next heading of that level or above."""
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert match is not None, f"no heading {heading!r}"
    level = len(match[1])
    end = re.search(rf"^#{{1,{level}}} ", text[match.end() :], re.M)
    return text[match.end() : match.end() + end.start() if end else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The cells of each body row of the Markdown tables in ``text``."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[\s|:-]+\|?", line.strip()):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if row[0] not in ("command", "flag")]  # headers


def commands_of(on: str) -> set[str]:
    """The commands a flag table's "on" cell names: ``all``, ``all but layers``, or a list."""
    if on == "all":
        return set(COMMANDS)
    if on.startswith("all but "):
        return set(COMMANDS) - set(re.split(r",\s*|\s+and\s+", on.removeprefix("all but ")))
    named = set(re.split(r",\s*", on))
    assert named <= set(COMMANDS), f"unknown commands in {on!r}"
    return named


def shared_flags() -> dict[str, set[str]]:
    """docs/cli.md's table of shared flags: flag -> the commands it is documented on."""
    table = {}
    for row in table_rows(section(CLI.read_text(), "Flags").split("Flags of one command")[0]):
        for flag in FLAG.findall(row[0]):
            table[flag] = commands_of(row[1])
    return table


def own_flags() -> dict[str, set[str]]:
    """docs/cli.md's "Flags of one command" list: command -> the flags its item names."""
    text = section(CLI.read_text(), "Flags").split("Flags of one command", 1)[1]
    items = re.findall(r"^- `([a-z]+)`:(.*(?:\n  .*)*)", text, re.M)
    assert items, "no items in Flags of one command"
    return {command: set(FLAG.findall(" ".join(re.findall(r"`([^`]*)`", body)))) for command, body in items}


# -- the commands -------------------------------------------------------------------------------------------------


def test_the_command_counts_in_words() -> None:
    cli = re.search(r"has (\w+) commands", CLI.read_text())
    index = re.search(r"\[Command line\]\(cli\.md\): the (\w+) commands", INDEX.read_text())
    readme = re.search(r"^(\w+) commands:", section(README.read_text(), "The CLI at a glance"), re.M)
    for page, found in (("docs/cli.md", cli), ("docs/index.md", index), ("README.md", readme)):
        assert found is not None, f"{page} does not say how many commands there are"
        assert number(found[1]) == len(COMMANDS), f"{page} says {found[1]}; there are {len(COMMANDS)}"


def test_the_command_table_lists_every_command() -> None:
    table = section(CLI.read_text(), "Command line").split("## ", 1)[0]
    listed = [re.match(r"`([a-z]+)", row[0]) for row in table_rows(table)]
    assert all(listed), table
    assert sorted(m[1] for m in listed if m) == sorted(COMMANDS)


def test_the_readme_summary_names_every_command() -> None:
    text = section(README.read_text(), "The CLI at a glance")
    summary = re.search(r"^\w+ commands:(.*?)Exit status", text, re.M | re.S)
    assert summary is not None, text
    named = re.findall(r"`([^`]+)`", summary[1])
    assert {word for word in named if not word.startswith("-")} == set(COMMANDS)
    everywhere = set().union(*map(flags, COMMANDS))
    assert {word for word in named if word.startswith("-")} <= everywhere


# -- the flags ----------------------------------------------------------------------------------------------------


def test_the_shared_flag_table_says_which_commands_take_each_flag() -> None:
    for flag, documented in shared_flags().items():
        actual = {command for command in COMMANDS if flag in flags(command)}
        assert documented == actual, f"docs/cli.md: {flag} is on {sorted(actual)}, documented on {sorted(documented)}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_a_command_is_documented_and_no_other(command: str) -> None:
    shared = {flag for flag, on in shared_flags().items() if command in on}
    own = own_flags().get(command, set())
    assert own <= flags(command), f"docs/cli.md documents {sorted(own - flags(command))} for {command}: no such flag"
    missing = flags(command) - shared - own
    assert not missing, f"docs/cli.md does not document {sorted(missing)} of {command}"


def command_lines(path: Path) -> list[tuple[str, str]]:
    """(command, its arguments) of every ``featurehooks COMMAND ...`` in a page: bash blocks and inline code."""
    prose, shell, fence = [], [], None  # fence: the language of the block being read
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence is None:
            prose.append(line)
        elif fence == "bash":
            shell.append(line)
    snippets = shell + re.findall(r"`([^`]+)`", "\n".join(prose))
    found = []
    for snippet in snippets:
        snippet = re.split(r"\s#\s|\s\|\s|\s&&\s|;\s|\s2?>\s", " ".join(snippet.split()))[0]
        for match in re.finditer(r"(?:^|\s)featurehooks\s+([a-z][a-z-]*)(.*?)(?=\s(?:python|torchrun)\s|$)", snippet):
            found.append((match[1], match[2]))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(REPO).as_posix() for page in PAGES])
def test_every_command_written_in_the_docs_exists_with_its_flags(page: Path) -> None:
    for command, arguments in command_lines(page):
        assert command in COMMANDS, f"{page.name}: featurehooks {command}: no such command"
        try:
            words = shlex.split(arguments)
        except ValueError:
            words = arguments.split()
        for word in words:
            flag = word.split("=", 1)[0]
            if flag.startswith("-") and not re.fullmatch(r"-[\d.e+-]+", flag):
                assert flag in flags(command) | HELP, f"{page.name}: featurehooks {command} has no {flag}"
