"""``selfspec serve``: the OpenAI-compatible HTTP server (``selfspec.serve``)."""

from __future__ import annotations

import argparse

from .common import add_model_args, load_generator, setup


def add_parser(sub) -> None:
    """Register ``selfspec serve`` on the subcommand set ``sub``."""
    sv = sub.add_parser("serve", help="an OpenAI-compatible server: /v1/chat/completions, /v1/completions, /metrics")
    from ..serve.command import add_serve_args

    add_model_args(sv)
    add_serve_args(sv)
    sv.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """An OpenAI-compatible HTTP server over the method (docs/serving.md)."""
    from ..serve.command import run_serve

    setup(args)
    # auto chooses among configurations whose requests share a batch, unless one at a time is asked for
    return run_serve(args, lambda: load_generator(args, args.method, batching=args.max_batch != 1))
