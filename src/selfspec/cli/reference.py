"""The command-line reference, ``docs/cli.md``, rendered from the argparse parsers themselves, so
it cannot drift from ``--help`` (``tests/cli/test_reference.py`` fails when the file is stale).

Regenerate it with::

    python -m selfspec.cli.reference > docs/cli.md
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterator
from typing import cast

WIDTH = 100  # help lines wrap here whatever the terminal, so the file is the same on every machine
PYTHON = (3, 11)  # argparse lays help out differently across Python versions: the file is made with this one

HEADER = """# Command-line reference

Every `selfspec` command and option, as `selfspec COMMAND --help` prints it. Generated from the
parsers by `python -m selfspec.cli.reference > docs/cli.md`; a test fails when this file is stale.
The README shows the commands most people need; this page is the whole of it.
(Laid out by Python {python}'s argparse; another Python's `--help` may wrap differently.)
"""


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``(command words, parser)`` for ``parser`` and every subcommand under it, depth first, in the
    order they were registered."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The Markdown reference: a contents list, then one section per command with its ``--help``
    text at :data:`WIDTH` columns. ``parser`` defaults to ``selfspec``'s own."""
    if parser is None:
        from . import build_parser

        parser = build_parser()
    commands = list(_commands(parser))
    out = [HEADER.format(python='.'.join(map(str, PYTHON)))]
    for words, _ in commands[1:]:
        out.append(f"- [`selfspec {' '.join(words)}`](#selfspec-{'-'.join(words)})")
    for words, p in commands:
        # formatter_class is a HelpFormatter class (typeshed's protocol of it omits width)
        p.formatter_class = functools.partial(cast("type[argparse.HelpFormatter]", p.formatter_class), width=WIDTH)
        title = " ".join(("selfspec", *words))
        out += ["", f"## {title}", "", "```text", p.format_help().rstrip(), "```"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
