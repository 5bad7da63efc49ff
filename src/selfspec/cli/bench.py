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
    if args.concurrency is not None:
        return concurrency(args)
    flags = {m: method_options(args, m, strict=False) for m in (*METHODS, AUTO) if m != BASELINE}
    return run_bench(BenchOptions.from_namespace(args, flags))


def concurrency(args: argparse.Namespace) -> int:
    """``selfspec bench --concurrency``: the server under concurrent clients (``selfspec.serve.concurrency``)."""
    from pathlib import Path

    from ..bench.datasets import load_dataset
    from ..bench.options import BenchOptions
    from ..errors import SelfspecError
    from ..registry import AUTO
    from ..serve.concurrency import LOAD_PEERS, ConcurrencyOptions, parse_levels, run_concurrency
    from .common import load_generator

    levels = parse_levels(args.concurrency)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.methods == BenchOptions.methods:
        method = AUTO
    elif len(methods) == 1:
        method = methods[0]
    else:
        raise SelfspecError(f"--concurrency serves one method: pass --methods NAME, not {args.methods!r}")
    if "," in args.kernels:
        raise SelfspecError(f"--concurrency serves one backend: pass --kernels NAME, not {args.kernels!r}")
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    for p in peers:
        if p not in LOAD_PEERS:
            raise SelfspecError(f"--concurrency's peers are {', '.join(LOAD_PEERS)}, not {p!r}")
    n = args.limit or 16
    texts = [p.text for p in load_dataset(args.dataset, limit=n)]
    while len(texts) < n:  # a small prompt set repeats
        texts += texts[: n - len(texts)]
    opts = ConcurrencyOptions(levels=levels, prompts=tuple(texts), max_new_tokens=args.max_new_tokens, peers=peers,
                              vllm_python=args.vllm_python, out=Path(args.out), serve_args=serve_args(args, method))
    model_dir = None
    if "vllm" in peers:
        from ..models.loading import resolve_path

        path, _ = resolve_path(args.model)
        if path is None or not path.is_dir():
            raise SelfspecError(f"--peers vllm loads a Hugging Face model directory; {args.model!r} is not one "
                                "(pull a bundled model first: selfspec models pull NAME)")
        model_dir = str(path)
    # the solo runs' configuration is the server's: auto among the ones whose requests share a batch
    return run_concurrency(opts, lambda: load_generator(args, method, batching=True), model_dir=model_dir)


def serve_args(args: argparse.Namespace, method: str) -> tuple[str, ...]:
    """``selfspec serve``'s arguments for the configuration ``bench --concurrency`` measures: the
    model, method, kernels, device, dtype, threads and draft model given (method options other
    than the draft model are not passed on)."""
    out = ["--model", args.model, "--method", method]
    for flag, value in (("--kernels", args.kernels), ("--device", args.device), ("--dtype", args.dtype),
                        ("--threads", args.threads), ("--draft-model", getattr(args, "draft_model", None))):
        if value is not None:
            out += [flag, str(value)]
    if args.trust_remote_code:
        out.append("--trust-remote-code")
    return tuple(out)
