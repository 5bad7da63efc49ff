"""``selfspec compile``: compile the ``compiled`` backend's decode steps ahead, once per machine.

A step of the compiled backend is one padded block size on one static-cache size; compiling one
takes most of a minute on a small CPU, loading a saved one a fraction of a second. ``auto``
never compiles while it chooses, so it times the compiled backend only for the methods whose
steps this command saved here. Each step is saved as it finishes: an interrupted run keeps what it
compiled, and running the command again compiles only what is missing.
"""

from __future__ import annotations

import argparse
import time

from ..errors import SelfspecError
from .common import THREADS_HELP, setup, threads_arg


def add_parser(sub) -> None:
    """Register ``selfspec compile`` on the subcommand set ``sub``."""
    from ..models.bundled import DEFAULT_MODEL
    from ..models.compiled_step import HEADROOM, MIN_CAPACITY

    pr = sub.add_parser("compile", help="compile the compiled kernels' decode steps ahead, once per machine "
                                        "(auto then times the compiled backend too)")
    pr.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"bundled name, local HF directory, .gguf file or hub id (default {DEFAULT_MODEL})")
    pr.add_argument("--methods", default=None,
                    help="comma-separated methods whose steps to compile (default: ar and every method auto "
                         "tries on this model)")
    pr.add_argument("--max-tokens", type=int, default=MIN_CAPACITY - HEADROOM,
                    help="also compile the larger static caches that requests of up to this many tokens (prompt + "
                         f"new) need (default {MIN_CAPACITY - HEADROOM}: the smallest cache only; a longer request "
                         "compiles its cache's steps when it first meets them)")
    pr.add_argument("--list", action="store_true", help="show which steps are saved and which are missing; compile "
                                                          "nothing")
    pr.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code (off by default)")
    pr.add_argument("--threads", type=threads_arg, default=None,
                    help=THREADS_HELP + " (steps are saved per thread count: compile with the threads you decode with)")
    pr.set_defaults(func=run, device="cpu")


def _methods(args: argparse.Namespace, target) -> dict[str, list[dict]]:
    """The methods to compile for, each with the options it runs with (every set ``auto`` tries, e.g.
    self-spec's draft precisions; else its defaults)."""
    from .. import autoselect
    from ..drafters.spec import AutoContext
    from ..registry import BASELINE, METHODS

    auto: dict[str, list[dict]] = {}
    for c in autoselect.candidates(target, METHODS.values(), ["compiled"], AutoContext()):
        auto.setdefault(c.method, []).append(dict(c.options))
    names = _names(args)
    return {BASELINE: [{}], **auto} if names is None else {m: auto.get(m, [{}]) for m in names}


def _names(args: argparse.Namespace) -> list[str] | None:
    """The methods ``--methods`` names (None: not given)."""
    from ..registry import METHODS

    if args.methods is None:
        return None
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise SelfspecError(f"unknown method '{unknown[0] if unknown else args.methods}' in --methods; choose from: "
                            f"{', '.join(METHODS)}")
    return names


def _label(options: dict) -> str:
    """A method's options as the command prints them (``draft_kernels=int8``, or ``defaults``)."""
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"


def run(args: argparse.Namespace) -> int:
    """Compile (or list) the steps each method verifies through, on the static caches requests up to
    ``--max-tokens`` need; saved under ``$SELFSPEC_HOME/compile``."""
    from ..api import build
    from ..models import aot_step
    from ..models.compiled_step import MIN_CAPACITY, capacity_for, compile_cache_dir
    from ..models.loading import load_model
    from ..registry import METHODS, compiled_blocks, method_config

    setup(args)
    if args.max_tokens < 1:
        raise SelfspecError("--max-tokens must be at least 1")
    _names(args)  # bad --methods: one line before anything loads
    target = load_model(args.model, "cpu", "float32", args.trust_remote_code, kernels="compiled")
    if compile_cache_dir() is None:
        raise SelfspecError("no writable cache directory for compiled steps: set SELFSPEC_HOME to a writable "
                            "directory")
    if not aot_step.supported(target.device):
        raise SelfspecError("this PyTorch cannot save compiled steps (torch.compile(...).aot_compile needs PyTorch "
                            ">= 2.10): the compiled backend compiles in each process instead")
    caps = [MIN_CAPACITY]
    while caps[-1] < capacity_for(args.max_tokens):
        caps.append(caps[-1] * 2)
    methods = _methods(args, target)
    hidden_of, skipped, drafting = {}, [], []
    # each method's drafter, built on the eager stock layers: whether it verifies with hidden states, and
    # that its artefacts are here. On the compiled backend a build would time the step for its cost profile,
    # compiling each block size outside the progress below (and under --list, which compiles nothing)
    for method, options in methods.items():
        try:
            g = build(target.runner("stock"), method, options[0], args.trust_remote_code, sizes=())
            hidden_of[method] = g.drafter.needs_hidden
        except SelfspecError as e:
            skipped.append(f"{method} ({e})")
            continue
        if METHODS[method].draft_step:  # may draft through a compiled step of its own
            drafting += [(method, o) for o in options]
    step = target.step
    assert step is not None
    # drafts through a step of their own (self-spec's int8 draft) whose step is not saved here
    drafts_todo: list[tuple[str, dict]] = []
    for m, o in drafting:
        draft_step = METHODS[m].draft_step  # set: drafting holds only such methods
        if draft_step is not None and draft_step(target, method_config(m, o)):
            drafts_todo.append((m, o))
    todo: list[tuple[int, int, bool]] = []
    ready = []
    for method, hidden in hidden_of.items():
        missing = [sh for c in caps for sh in step.missing(c, compiled_blocks(method), hidden)]
        todo += [sh for sh in missing if sh not in todo]
        if not missing and not any(m == method for m, _ in drafts_todo):
            ready.append(method)
    for s in skipped:
        print(f"selfspec: skipped {s}")
    shapes = ", ".join(f"{t}x{c}" + ("+hidden" if h else "") for t, c, h in todo) or "none"
    drafts = "".join(f"; {m} ({_label(o)}): draft step to compile" for m, o in drafts_todo)
    print(f"{target.name}: steps saved for {', '.join(ready) or 'no method'}; {len(todo)} to compile ({shapes}; "
          f"block x cache){drafts}")
    if args.list:
        return 0
    t0 = time.perf_counter()
    if todo:
        print("each takes most of a minute on a small CPU (once per machine and thread count); an interrupted run "
              "keeps what it compiled")
    for i, (size, cap, hidden) in enumerate(sorted(todo), 1):
        step.warm_up(cap, (size,), hidden)
        spent = time.perf_counter() - t0
        left = spent / i * (len(todo) - i)
        print(f"[{i}/{len(todo)}] {size}-token blocks, {cap}-position cache{', hidden states' if hidden else ''}: "
              f"saved ({spent:.0f} s so far{f', about {left / 60:.0f} min left' if i < len(todo) else ''})",
              flush=True)
    for method, opts in drafting:  # drafts through a step of their own (self-spec's int8 draft): built here
        g = build(target, method, opts, args.trust_remote_code, sizes=())  # compiles (or loads) it at MIN_CAPACITY
        if g.drafter.warm_up(MIN_CAPACITY) == 0.0:
            continue  # no step of its own: this draft runs eagerly
        for c in caps[1:]:
            g.drafter.warm_up(c)
        print(f"{method} ({_label(opts)}): draft step saved ({time.perf_counter() - t0:.0f} s so far)", flush=True)
    if todo or drafts_todo:
        print(f"done in {time.perf_counter() - t0:.0f} s; auto now times the compiled kernels too "
              f"(its cached choice is measured again on the next run)")
    return 0
