"""``selfspec bench``: methods and peers against ``ar`` on a prompt set (``selfspec.bench``)."""

from __future__ import annotations

import argparse

from ..options import method_options
from .common import add_model_args, setup


def add_parser(sub) -> None:
    """Register ``selfspec bench`` on the subcommand set ``sub``."""
    b = sub.add_parser("bench", help="measure methods and peers against ar on a prompt set")
    from ..bench.options import add_bench_args

    add_bench_args(b)
    add_model_args(b, method=False, many=True)
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.command import run_bench
    from ..bench.options import BenchOptions
    from ..registry import AUTO, BASELINE, METHODS

    setup(args)
    flags = {m: method_options(args, m, strict=False) for m in (*METHODS, AUTO) if m != BASELINE}
    return run_bench(BenchOptions.from_namespace(args, flags))
