"""``selfspec`` command line: one module per subcommand (generate, demo, serve, bench, profile, tune,
export, models; ``train`` lives with the training code), sharing :mod:`.common`.

Every user error prints one line ``selfspec: error: ...`` and exits with code 2; Ctrl-C prints
``selfspec: interrupted`` and exits with code 130.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence

from ..errors import SelfspecError
from ..notes import notes_on_stderr
from . import bench, compile, demo, export, generate, models, profile, serve, tune
from .common import EXIT_USAGE, Parser, version

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def build_parser() -> argparse.ArgumentParser:
    """The ``selfspec`` parser: each subcommand's module registers its own options."""
    p = Parser(prog="selfspec", description="Lossless speculative decoding on Hugging Face models.")
    p.add_argument("--version", action="version", version=f"selfspec {version()}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    for command in (generate, demo, models, compile, profile, tune):
        command.add_parser(sub)
    from ..train.command import add_train_parser

    add_train_parser(sub)  # selfspec train OBJECTIVE: each objective's options (train/command.py)
    for command in (export, serve, bench):
        command.add_parser(sub)
    for action in sub._choices_actions:  # each command's --help starts with what it does, as train's do
        command_parser = sub.choices[action.dest]
        if command_parser.description is None:
            command_parser.description = action.help
    return p


def _resume_hint(args: argparse.Namespace | None) -> str:
    """How to continue an interrupted command that keeps its progress (train, bench: --resume;
    tune: its --state), or nothing."""
    if args is None:
        return ""
    if hasattr(args, "resume"):  # train, bench: checkpoints / records in --out
        again = "run the same command again" if args.resume else "run the same command with --resume"
        return f"; {again} to continue from where it stopped (--out {args.out})"
    if getattr(args, "cmd", None) == "compile":
        return "; run the same command again to compile what is missing (the steps compiled so far are saved)"
    if getattr(args, "cmd", None) == "tune" and getattr(args, "state", None):
        return f"; run the same command again to continue the search (--state {args.state})"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with notes_on_stderr() as set_quiet:
        return _main(argv, set_quiet)


def _main(argv: Sequence[str] | None, set_quiet: Callable[[bool], None]) -> int:
    args = None
    try:  # Ctrl-C at any time, the imports of building the parser and loading a model included
        args = build_parser().parse_args(argv)
        set_quiet(getattr(args, "quiet", False))
        args.command_line = ["selfspec", *(sys.argv[1:] if argv is None else argv)]  # recorded by bench
        return args.func(args)
    except SelfspecError as e:
        print(f"selfspec: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"selfspec: interrupted{_resume_hint(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`selfspec models list | head -1`): no traceback
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1

