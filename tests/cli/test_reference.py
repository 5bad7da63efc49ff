"""docs/cli.md is the parsers' own --help: regenerated in memory, it must equal the file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from selfspec.cli import build_parser
from selfspec.cli.reference import PYTHON, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


@pytest.mark.skipif(sys.version_info[:2] != PYTHON, reason="argparse's layout differs across Python versions; "
                    f"docs/cli.md is made with Python {PYTHON}")
def test_docs_cli_md_is_up_to_date():
    assert DOC.is_file(), "docs/cli.md is missing: python -m selfspec.cli.reference > docs/cli.md"
    assert DOC.read_text() == render(), "docs/cli.md is stale: python -m selfspec.cli.reference > docs/cli.md"


def test_every_command_and_option_is_in_the_reference():
    text = render()
    parser = build_parser()
    sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)][0]
    for name, command in sub.choices.items():
        assert f"## selfspec {name}\n" in text, name
        for action in command._actions:
            for flag in action.option_strings:
                assert flag in text, (name, flag)


@pytest.mark.skipif(sys.version_info[:2] != PYTHON, reason="docs/cli.md is made with another Python")
def test_a_changed_help_makes_the_reference_stale():
    """Negative control: a parser whose help differs renders differently from the file."""
    parser = build_parser()
    parser.description = "something else"
    assert render(parser) != DOC.read_text()
