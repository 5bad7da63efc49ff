"""What every ``selfspec`` subcommand shares: the parser class (one-line errors, exit 2), the model,
method and generation flags, the checks run before a model loads, and the stats line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from ..config import SAMPLING_MODES, seed_arg, threads_arg
from ..errors import SelfspecError
from ..options import add_method_flags, method_options

EXIT_USAGE = 2
COLOURS = ("\x1b[48;5;24m", "\x1b[48;5;94m", "\x1b[48;5;22m", "\x1b[48;5;90m")
RESET = "\x1b[0m"
THREADS_HELP = ("torch CPU threads, at least 1 (default: torch's choice, usually one per core; on a machine busy "
                "with other work, --threads 1 can be several times faster)")


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.add_help:  # every command takes -q, before or after its name
            self.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                              help="print warnings and errors only, not progress notes")

    def error(self, message: str) -> NoReturn:  # one line, exit 2, naming the help of the command at fault
        print(f"selfspec: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but unknown options are reported by the (sub)command that was given
        them, so the error points to ``selfspec generate --help``, not ``selfspec --help``."""
        argv = list(sys.argv[1:] if args is None else args)
        ns, extras = self.parse_known_args(argv, namespace)
        if extras:
            last = max((argv.index(x) for x in extras if x in argv), default=len(argv))
            self._command(ns, argv, last).error(
                f"unrecognized arguments: {' '.join(extras)}")
        return ns

    def _command(self, ns: argparse.Namespace, argv: list[str], last: int) -> argparse.ArgumentParser:
        """The innermost (sub)command parser that ``ns`` selected and whose name comes before
        ``argv[last]`` (``self`` when none does)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(ns, action.dest, None) or ""
                chosen = action.choices.get(name)
                if isinstance(chosen, Parser) and name in argv[:last]:
                    return chosen._command(ns, argv[argv.index(name) + 1:], last - argv.index(name) - 1)
        return self


def version() -> str:
    """``selfspec.__version__`` (the package metadata's version)."""
    from .. import __version__

    return __version__


def method_names() -> str:
    from ..registry import AUTO, AUTO_HELP, METHODS

    return f"{AUTO} ({AUTO_HELP}), " + ", ".join(
        f"{k}{'' if v.lossless else ' (NOT lossless)'}" for k, v in METHODS.items())


def kernels_arg(many: bool):
    """argparse type of ``--kernels``: one backend, or with ``many`` a comma-separated list."""
    from ..kernels import KERNELS

    def parse(value: str) -> str:
        names = [v.strip() for v in value.split(",") if v.strip()] if many else [value]
        bad = [n for n in names if n not in KERNELS]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown kernels '{bad[0] if bad else value}'; choose from "
                                             f"{', '.join(KERNELS)}")
        return ",".join(dict.fromkeys(names))

    return parse


def add_model_args(p: argparse.ArgumentParser, method: bool = True, many: bool = False,
                    method_flags: bool = True) -> None:
    from ..models.bundled import DEFAULT_MODEL
    from ..registry import AUTO

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"bundled name, local HF directory, .gguf file or hub id (default {DEFAULT_MODEL})")
    if method:
        p.add_argument("--method", default=AUTO, help=f"decoding method: {method_names()} (default {AUTO})")
        p.add_argument("--remeasure", action="store_true",
                       help=f"with --method {AUTO} or --kernels auto: calibrate again instead of using the cached "
                            "choice")
        p.add_argument("--no-measure", action="store_true",
                       help="measure nothing and write nothing: auto uses its cached choice, else plain ar; drafts "
                            "are sized from cached cost profiles, else fixed sizes")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto (CUDA if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (float32 gives exact greedy equality; default float32)")
    p.add_argument("--kernels", default=os.environ.get("SELFSPEC_KERNELS") or "auto", type=kernels_arg(many),
                   help="linear-layer backend: auto (default, or $SELFSPEC_KERNELS: the fp32 backend that decodes "
                        "fastest here, chosen with the method, measured once and cached), stock (PyTorch's "
                        "kernels), onednn (fp32 prepacked, CPU), int8 (QUANTISED model: lossless w.r.t. the "
                        "int8 model, not the fp32 one), compact (fp32 products that read each weight as the GGUF block "
                        "it came from, Q4_1 or Q8_0, proven bit for bit at load; CPU with AVX2, builds its kernel "
                        "once with g++; lossless w.r.t. ar on it) or compiled (onednn kernels on CPU, verification "
                        "through a static-shape step under torch.compile: each block size compiles once, minutes on a "
                        "small CPU, cached in $SELFSPEC_HOME/compile; lossless w.r.t. ar on it)"
                        + ("; comma-separated to compare backends in one run" if many else ""))
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code (off by default)")
    p.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    if method_flags:  # --k, --head, ...: not for commands that run no method (profile)
        add_method_flags(p)


def add_gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="generated tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=seed_arg, default=None,
                   help="seed of the sampler; default: a fresh random seed, reported in --json and the stats line")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable); generation ends at it, and the text ends before it unless "
                        "--include-stop")
    p.add_argument("--include-stop", action="store_true",
                   help="keep the stop string at the end of the text (default: excluded, as in the OpenAI API)")
    p.add_argument("--sampling", default="coupled", choices=SAMPLING_MODES,
                   help="coupled: Gumbel-max sampling keyed by (seed, position): the same seed gives the same text "
                        "for every method (default); rejection: speculative rejection sampling, lossless in "
                        "distribution but the text depends on the draft")
    p.add_argument("--no-chat", action="store_true", help="use the prompt as raw text, without the chat template")


def gen_kwargs(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), chat=not args.no_chat,
                sampling=args.sampling, include_stop=args.include_stop)


def setup(args: argparse.Namespace) -> None:
    import torch

    from ..config import GenerationConfig
    from ..registry import AUTO, method_config

    if hasattr(args, "temperature"):  # validate everything cheap before loading a model
        GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                         top_k=args.top_k, seed=args.seed, stop=tuple(getattr(args, "stop", ())))
        if args.temperature == 0 and getattr(args, "cmd", None) in ("generate", "demo"):  # --seed given: not None
            unused = [f for f, given in (("--seed", args.seed is not None), ("--top-p", args.top_p != 1.0),
                                         ("--top-k", args.top_k != 0)) if given]
            if unused:
                named = " and ".join(unused)
                print(f"selfspec: note: {named} only appl{'ies' if len(unused) == 1 else 'y'} when sampling; at "
                      f"--temperature 0 decoding is greedy (add --temperature > 0 to sample, or drop {named})",
                      file=sys.stderr)
    if getattr(args, "show_accepted", None) and getattr(args, "json", False):
        raise SelfspecError("--show-accepted colours streamed text and --json prints one object: drop one of them")
    if getattr(args, "method", None):
        method_config(args.method, method_options(args, args.method))
    if getattr(args, "remeasure", False) and getattr(args, "method", None) not in (None, AUTO) \
            and getattr(args, "kernels", None) != "auto":
        raise SelfspecError(f"--remeasure applies where something is chosen: --method {AUTO} or --kernels auto")
    if getattr(args, "remeasure", False) and getattr(args, "no_measure", False):
        raise SelfspecError("--remeasure measures again and --no-measure measures nothing: drop one of them")
    check_device(args)

    if args.threads:
        torch.set_num_threads(args.threads)


def check_device(args: argparse.Namespace) -> None:
    """A ``--device`` this machine lacks is a one-line error before anything loads."""
    if getattr(args, "device", None) is not None:
        from ..models.loading import resolve_device

        resolve_device(args.device)


def load_generator(args: argparse.Namespace, method: str | None = None, model=None, batching: bool = False):
    """The generator of ``method`` with its options from the flags; without ``method``, the
    baseline (no options), which ``demo`` runs beside ``--method``. ``batching``: ``auto`` chooses
    among configurations whose requests share a batch (``selfspec serve``)."""
    from ..api import load
    from ..registry import AUTO, BASELINE

    opts = method_options(args, method) if method else {}
    chooses = method == AUTO or (method is not None and model is None and args.kernels == "auto")
    extra = {"remeasure": True} if chooses and getattr(args, "remeasure", False) else {}
    if getattr(args, "no_measure", False):
        extra["measure"] = False
    return load(model=model or args.model, method=method or BASELINE, device=args.device, dtype=args.dtype,
                trust_remote_code=args.trust_remote_code, kernels=None if model else args.kernels,
                batching=batching, **extra, **opts)


def kernels_label(kernels: str, device: str = "cpu") -> str:
    """How reports name a backend: int8 always says that the model is quantised, and how wide
    its activations are (7 bits on CPUs without VNNI)."""
    if kernels != "int8":
        return kernels
    from ..kernels.int8 import activation_bits

    return f"int8 (quantised model, {activation_bits(device)}-bit activations)"


def stats_line(r) -> str:
    seed = getattr(r, "seed", None)  # sampled: the seed that reproduces the text (--seed N)
    sampled = f"; seed {seed} ({getattr(r, 'sampling', 'coupled')} sampling)" if seed is not None else ""
    from ..autoselect import AUTO_PREFIX

    named = r.method.startswith(AUTO_PREFIX) and r.kernels != "int8"  # auto's label names the kernels
    kernels = "" if named else f", {kernels_label(r.kernels)} kernels"
    return (f"[{r.method}{'' if r.lossless else ' NOT LOSSLESS'}{kernels}] "
            f"{r.new_tokens} tokens in {r.wall_s:.2f} s = "
            f"{r.tokens_per_s:.1f} tok/s; {r.steps} target forwards, tau {r.mean_accepted:.2f}{sampled}")
