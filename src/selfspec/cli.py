"""``selfspec`` command line: generate | demo | serve | bench | profile | models.

Every user error prints one line ``selfspec: error: ...`` and exits with code 2; Ctrl-C prints
``selfspec: interrupted`` and exits with code 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from .config import SAMPLING_MODES, seed_arg, threads_arg
from .errors import SelfspecError
from .options import add_method_flags, method_options

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
COLOURS = ("\x1b[48;5;24m", "\x1b[48;5;94m", "\x1b[48;5;22m", "\x1b[48;5;90m")
RESET = "\x1b[0m"
THREADS_HELP = ("torch CPU threads, at least 1 (default: torch's choice, usually one per core; on a machine busy "
                "with other work, --threads 1 can be several times faster)")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.add_help:  # every command takes -q, before or after its name
            self.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                              help="print warnings and errors only, not progress notes")

    def error(self, message: str) -> None:  # one line, exit 2, naming the help of the command at fault
        print(f"selfspec: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
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
                if isinstance(chosen, _Parser) and name in argv[:last]:
                    return chosen._command(ns, argv[argv.index(name) + 1:], last - argv.index(name) - 1)
        return self


def _version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    from importlib import metadata

    try:
        return metadata.version("selfspec")
    except metadata.PackageNotFoundError:
        from . import __version__

        return __version__


def _method_names() -> str:
    from .registry import AUTO, AUTO_HELP, METHODS

    return f"{AUTO} ({AUTO_HELP}), " + ", ".join(
        f"{k}{'' if v.lossless else ' (NOT lossless)'}" for k, v in METHODS.items())


def _kernels_arg(many: bool):
    """argparse type of ``--kernels``: one backend, or with ``many`` a comma-separated list."""
    from .kernels import KERNELS

    def parse(value: str) -> str:
        names = [v.strip() for v in value.split(",") if v.strip()] if many else [value]
        bad = [n for n in names if n not in KERNELS]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown kernels '{bad[0] if bad else value}'; choose from "
                                             f"{', '.join(KERNELS)}")
        return ",".join(dict.fromkeys(names))

    return parse


def _add_model_args(p: argparse.ArgumentParser, method: bool = True, many: bool = False,
                    method_flags: bool = True) -> None:
    from .models.bundled import DEFAULT_MODEL
    from .registry import AUTO

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"bundled name, local HF directory, .gguf file or hub id (default {DEFAULT_MODEL})")
    if method:
        p.add_argument("--method", default=AUTO, help=f"decoding method: {_method_names()} (default {AUTO})")
        p.add_argument("--remeasure", action="store_true",
                       help=f"with --method {AUTO} or --kernels auto: calibrate again instead of using the cached "
                            "choice")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto (CUDA if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (float32 gives exact greedy equality; default float32)")
    p.add_argument("--kernels", default=os.environ.get("SELFSPEC_KERNELS") or "auto", type=_kernels_arg(many),
                   help="linear-layer backend: auto (default, or $SELFSPEC_KERNELS: the fp32 backend that decodes "
                        "fastest here, chosen with the method, measured once and cached), stock (PyTorch's "
                        "kernels), onednn (fp32 prepacked, CPU) or int8 (QUANTISED model: lossless w.r.t. the "
                        "int8 model, not the fp32 one)"
                        + ("; comma-separated to compare backends in one run" if many else ""))
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code (off by default)")
    p.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    if method_flags:  # --k, --head, ...: not for commands that run no method (profile)
        add_method_flags(p)


def _add_gen_args(p: argparse.ArgumentParser) -> None:
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


def _gen_kwargs(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), chat=not args.no_chat,
                sampling=args.sampling, include_stop=args.include_stop)


def _setup(args: argparse.Namespace) -> None:
    import torch

    from .config import GenerationConfig
    from .registry import AUTO, method_config

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
    _check_device(args)

    if args.threads:
        torch.set_num_threads(args.threads)


def _check_device(args: argparse.Namespace) -> None:
    """A ``--device`` this machine lacks is a one-line error before anything loads."""
    if getattr(args, "device", None) is not None:
        from .models.loading import resolve_device

        resolve_device(args.device)


def _load(args: argparse.Namespace, method: str | None = None, model=None):
    """The generator of ``method`` with its options from the flags; without ``method``, the
    baseline (no options), which ``demo`` runs beside ``--method``."""
    from .api import load
    from .registry import AUTO, BASELINE

    opts = method_options(args, method) if method else {}
    chooses = method == AUTO or (method is not None and model is None and args.kernels == "auto")
    extra = {"remeasure": True} if chooses and getattr(args, "remeasure", False) else {}
    return load(model=model or args.model, method=method or BASELINE, device=args.device, dtype=args.dtype,
                trust_remote_code=args.trust_remote_code, kernels=None if model else args.kernels,
                **extra, **opts)


def kernels_label(kernels: str, device: str = "cpu") -> str:
    """How reports name a backend: int8 always says that the model is quantised, and how wide
    its activations are (7 bits on CPUs without VNNI)."""
    if kernels != "int8":
        return kernels
    from .kernels.int8 import activation_bits

    return f"int8 (quantised model, {activation_bits(device)}-bit activations)"


def _stats_line(r) -> str:
    seed = getattr(r, "seed", None)  # sampled: the seed that reproduces the text (--seed N)
    sampled = f"; seed {seed} ({getattr(r, 'sampling', 'coupled')} sampling)" if seed is not None else ""
    from .autoselect import AUTO_PREFIX

    named = r.method.startswith(AUTO_PREFIX) and r.kernels != "int8"  # auto's label names the kernels
    kernels = "" if named else f", {kernels_label(r.kernels)} kernels"
    return (f"[{r.method}{'' if r.lossless else ' NOT LOSSLESS'}{kernels}] "
            f"{r.new_tokens} tokens in {r.wall_s:.2f} s = "
            f"{r.tokens_per_s:.1f} tok/s; {r.steps} target forwards, tau {r.mean_accepted:.2f}{sampled}")


def cmd_generate(args: argparse.Namespace) -> int:
    _setup(args)
    g = _load(args, args.method)
    kw = _gen_kwargs(args)
    if args.json:
        r = g.generate(args.prompt, **kw)
        print(json.dumps(r.to_dict()))
        g.save_cost_correction()
        return 0
    colour = args.show_accepted and sys.stdout.isatty() or args.show_accepted == "always"
    for step, (piece, _) in enumerate(g.stream_steps(args.prompt, **kw)):
        if piece:
            if args.show_accepted:
                piece = f"{COLOURS[step % len(COLOURS)]}{piece}{RESET}" if colour else f"[{piece}]"
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    print(_stats_line(g.last_result), file=sys.stderr)
    g.save_cost_correction()
    return 0


DEMO_PROMPT = (
    "Add type hints and a docstring to this function, and return the whole function:\n\n"
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n"
    "        result.append(sum(chunk) / window)\n"
    "    return result\n"
)


DEMO_RUNS = 2  # each contender runs this often, interleaved; the fastest run counts (as timeit does)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: ``ar``, a speculative method (default ``auto``) and ``transformers`` ``generate``
    side by side on the same prompt, the same model, the same number of tokens."""
    from .bench.peers import run_peer
    from .decoding.text import encode_prompt

    _setup(args)
    prompt = args.prompt or DEMO_PROMPT
    kw = _gen_kwargs(args)
    if kw["seed"] is None:  # one fresh seed for every contender (each would draw its own), shown in stats
        import secrets

        kw["seed"] = secrets.randbits(31)
    spec = _load(args, args.method)  # auto: chooses method and kernels; ar then runs on the same kernels
    ar = _load(args, model=spec.target)  # the baseline
    target = ar.target
    ids = encode_prompt(target.tokenizer, prompt, kw["chat"], target.model.config.vocab_size)

    def hf_generate(max_new_tokens: int):
        target.use_kernels("stock", keep=True)  # transformers as users run it: fp32, stock kernels
        try:
            return run_peer("hf", target.model, ids, max_new_tokens, kw["temperature"], kw["top_p"], kw["top_k"],
                            kw["seed"])
        finally:
            target.use_kernels(ar.kernels, keep=True)

    warm = dict(kw, max_new_tokens=8)
    ar.generate(prompt, **warm)
    spec.generate(prompt, **warm)
    hf_generate(8)
    from .core.machine import LoadMonitor

    with LoadMonitor() as load:  # was the machine busy before or during the timed runs?
        runs: list[tuple] = [(ar.generate(prompt, **kw), spec.generate(prompt, **kw),
                              hf_generate(kw["max_new_tokens"]))
                             for _ in range(DEMO_RUNS)]  # interleaved; the fastest run of each counts
    a, s, hf = (min((run[i] for run in runs), key=lambda r: r.wall_s) for i in range(3))
    hf_wall = hf.wall_s
    for r in (a, s):
        print(f"===== {r.method}{'' if r.lossless else ' (NOT lossless)'} =====")
        print(r.text)
        print(_stats_line(r))
        print()
    same = a.token_ids == s.token_ids
    same_hf = a.token_ids == hf.token_ids  # both keep the EOS token
    hf_tps = len(hf.token_ids) / hf_wall if hf_wall > 0 else 0.0
    print("===== transformers generate (fp32, stock kernels) =====")
    print(f"(same token ids as {a.method})" if same_hf
          else target.tokenizer.decode(hf.token_ids, skip_special_tokens=True))
    print()
    print(f"model {a.model} | {a.method} and {s.method} on {kernels_label(a.kernels)} kernels | prompt "
          f"{a.prompt_tokens} tokens | {a.new_tokens} new tokens | fastest of {DEMO_RUNS} runs each")
    print(f"{a.method} {a.tokens_per_s:.1f} tok/s | {s.method} {s.tokens_per_s:.1f} tok/s | transformers generate "
          f"{hf_tps:.1f} tok/s")
    vs_hf = hf_wall * a.new_tokens / max(len(hf.token_ids), 1) / s.wall_s
    print(f"{s.method}: speedup {a.wall_s / s.wall_s:.2f}x over {a.method}, {vs_hf:.2f}x over transformers "
          f"generate | token ids identical to {a.method}: {'yes' if same else 'NO'}, to transformers generate: "
          f"{'yes' if same_hf else 'no (kernel rounding near a tie; see docs/performance.md)'}")
    if load.note():
        print(load.note(), file=sys.stderr)
    spec.save_cost_correction()
    if kw["temperature"] == 0 and not same and s.lossless:
        print("selfspec: error: greedy outputs differ; please report this", file=sys.stderr)
        return 1
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from . import paths
    from .models import bundled

    if args.models_cmd == "pull":
        path = bundled.pull(args.name, force=args.force)
        print(path)
        return 0
    for name, m in bundled.BUNDLED.items():
        d = bundled.model_dir(name)
        state = "pulled" if (d / bundled.MANIFEST).is_file() else "not pulled"
        default = " (default)" if name == bundled.DEFAULT_MODEL else ""
        print(f"{name:30s} {state:11s} {m.family:6s} {m.license:22s} {m.note}{default}")
    for name, f in bundled.FINETUNED.items():
        d = bundled.model_dir(name)
        state = "pulled" if (d / bundled.MANIFEST).is_file() else "not pulled"
        shipped = "" if (bundled.adapter_dir(name) / "selfspec_finetune.json").is_file() else f" [build: {f.build}]"
        print(f"{name:30s} {state:11s} {f.method:6s} {'(base licence)':22s} {f.note}{shipped}")
    print(f"cache: {paths.selfspec_home()} (set SELFSPEC_HOME to move it)")
    w = paths.writable_cache_dir("profiles")
    if w != paths.selfspec_home() / "profiles":  # a read-only (shared) home: used read-only
        print(f"the cache is read-only: cost profiles and choices go to {w.parent if w else 'nowhere (not cached)'}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.runner import BenchOptions, run_bench
    from .registry import AUTO, BASELINE, METHODS

    _setup(args)
    flags = {m: method_options(args, m, strict=False) for m in (*METHODS, AUTO) if m != BASELINE}
    return run_bench(BenchOptions.from_namespace(args, flags))


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure (or show the cached) verify cost curve T(q) that drafters size their drafts from:
    the medians of interleaved repeats (raw) and their non-decreasing fit, which drafters use."""
    from .core import cost
    from .models.loading import load_model

    _setup(args)
    if args.max_q < 1 or args.reps < 1:
        raise SelfspecError("--max-q and --reps must be at least 1")
    target = load_model(args.model, args.device, args.dtype, args.trust_remote_code, kernels=args.kernels)
    key = cost.profile_key(target.model, target.name, target.backend)
    qs = tuple(q for q in cost.PROFILE_QS if q < args.max_q) + (args.max_q,)
    # a cache that stops short of --max-q, or has drifted, is measured again (with the qs it had)
    prof, measured = cost.cached_or_measure(target.model, key, qs, remeasure=args.remeasure, max_q=args.max_q,
                                            reps=args.reps, progress=True, what=args.model)
    print(f"verify cost profile of {args.model} on {kernels_label(target.backend)} kernels "
          f"({prof.context}-token cache), {key.split('|', 3)[-1]}")
    print("    q   ms/forward   T(q)/T(1)   ms/token   raw median ms   spread ms")
    raw = prof.raw or prof.seconds
    spread = prof.spread or (0.0,) * len(prof.qs)
    for q, t, m, sp in zip(prof.qs, prof.seconds, raw, spread):
        if q <= args.max_q:
            fitted = "  (fitted)" if abs(m - t) > 0.005 * t else ""  # pooled with a neighbour by the fit
            print(f"{q:5d} {t * 1000:12.1f} {t / prof.t1:11.2f} {t * 1000 / q:10.1f} {m * 1000:15.1f} "
                  f"{sp * 1000:11.1f}{fitted}")
    if prof.source == "corrected":
        n = sum(c for _, c in prof.observations)
        print(f"ms/forward: the non-decreasing fit of the raw medians, corrected with {n} verify timings while "
              f"decoding (they differed by up to {prof.last_drift:.0%} from the profile before)")
    else:
        print(f"ms/forward: the non-decreasing fit of the raw medians of {prof.reps or 'unrecorded'} interleaved "
              "rounds")
    if measured:
        print(f"saved: {prof.path}" if prof.path is not None else "not saved: no writable cache")
    else:
        print(f"cached: {cost.profile_path(key)} (use --remeasure to measure again)")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    """Search the method's configuration on calibration prompts and write it where load finds it."""
    from .models.loading import load_model
    from .tune import TUNERS, TuneOptions

    if args.model and args.model_flag and args.model != args.model_flag:
        raise SelfspecError(f"two models given ({args.model} and --model {args.model_flag}); give one")
    args.model = args.model_flag or args.model
    if not args.model:
        raise SelfspecError("selfspec tune needs a model: --model MODEL (see selfspec tune --help)")
    if args.method not in TUNERS:
        raise SelfspecError(f"selfspec tune supports --method {', '.join(TUNERS)} only, not {args.method!r}")
    opts = TuneOptions(objective=args.objective, trials=args.trials, time_budget=args.time_budget,
                       prompts=args.prompts or "", category=args.calib_category or "", num_prompts=args.calib_prompts,
                       new_tokens=args.calib_tokens, draft_exit=args.draft_exit, rerank=args.rerank, seed=args.seed,
                       state_dir=args.state or "", fresh=args.fresh, out=args.out or "",
                       draft_vocab=args.draft_vocab, draft_kernels=args.draft_kernels)
    opts.check()
    _check_device(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target = load_model(args.model, args.device, args.dtype, args.trust_remote_code, kernels=args.kernels)
    cfg, path = TUNERS[args.method](target, opts)
    s = cfg.search
    what = (f"measured {s.get('tokens_per_s', 0):.1f} tok/s, {s.get('speedup', 0):.2f}x ar" if args.objective == "speed"
            else f"predicted {s['score']:.2f}x ar, top-1 agreement {s['top1_agreement']:.2f}"
            + (f", measured {s['measured_speedup']:.2f}x" if "measured_speedup" in s else ""))
    print(f"skip {len(cfg.skip_attention)} attention + {len(cfg.skip_mlp)} MLP of {2 * cfg.num_layers} sub-layers "
          f"(attention {list(cfg.skip_attention)}, MLP {list(cfg.skip_mlp)}); {what}; {s['trials']} trials")
    print(f"skip config: {path}")
    from .tune.self_spec import SLOWER_FILE

    if path.name == SLOWER_FILE and not args.out:
        print(f"not installed: it measured {s.get('speedup', s.get('measured_speedup', 0)):.2f}x ar, slower than "
              f"plain decoding, so --method self-spec keeps its current config; try more --trials, or use it anyway "
              f"with --skip-config {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a trained head as an EAGLE-1/2 draft that vLLM, SGLang or SafeAILab EAGLE loads."""
    from pathlib import Path

    from .drafters.eagle import EAGLE2, HASS
    from .heads import find_head_dir
    from .heads.export import check_export_dir, default_dtype, export_head, serve_hint
    from .models.loading import load_model

    check_export_dir(args.out)  # before the model loads
    target = load_model(args.model, "cpu", "float32", args.trust_remote_code)
    head = args.head
    if head in (EAGLE2.name, HASS.name) and not Path(head).is_dir():  # the model's installed head
        found = find_head_dir(target.name, head)
        if found is None:
            raise SelfspecError(f"no trained {head} head for model '{target.name}': train one with `selfspec train "
                                f"hass --model {target.name} --out DIR` and pass DIR")
        head = str(found)
    dtype = args.dtype or default_dtype(target.path)
    res = export_head(head, target.model, args.engine, args.out, dtype, args.with_embeddings)
    print(f"{args.engine} EAGLE draft: {res.out} ({', '.join(res.files)}; {res.dtype})")
    hint = serve_hint(res, str(target.path or target.name), target.path)
    for note in [*(f"note: {n}" for n in res.notes), *(h for h in hint if h.startswith("note:"))]:
        print(note)  # what needs doing first, then the command
    for line in hint:
        if not line.startswith("note:"):
            print(line)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible HTTP server over the method (docs/serving.md)."""
    from .serve.command import run_serve

    _setup(args)
    return run_serve(args, lambda: _load(args, args.method))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="selfspec", description="Lossless speculative decoding on Hugging Face models.")
    p.add_argument("--version", action="version", version=f"selfspec {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text, streaming it as drafts are accepted")
    _add_model_args(g)
    _add_gen_args(g)
    g.add_argument("--show-accepted", nargs="?", const="auto", default=None, choices=["auto", "always"],
                   help="colour tokens by the step that accepted them")
    g.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    g.add_argument("prompt", help="the prompt text")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="side by side: ar against a speculative method on one prompt")
    _add_model_args(d)
    _add_gen_args(d)
    d.add_argument("prompt", nargs="?", default=None, help="prompt (default: a code-editing prompt)")
    d.set_defaults(func=cmd_demo)

    m = sub.add_parser("models", help="list or pull bundled models")
    msub = m.add_subparsers(dest="models_cmd", required=True, parser_class=_Parser)
    msub.add_parser("list", help="list bundled models and whether they are pulled")
    pull = msub.add_parser("pull", help="download and convert a bundled model into the cache")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="convert again even if the cache is intact")
    m.set_defaults(func=cmd_models)

    pr = sub.add_parser("profile", help="measure the verify cost curve T(q) on this machine (drafters use it)")
    _add_model_args(pr, method=False, method_flags=False)
    pr.add_argument("--max-q", type=int, default=64,
                    help="largest block size measured (default 64; a cached profile that stops short of it is "
                         "measured again)")
    pr.add_argument("--reps", type=int, default=5,
                    help="interleaved rounds (at least 3 are run); medians are reported (default 5)")
    pr.add_argument("--remeasure", action="store_true", help="measure again even if a profile is cached")
    pr.set_defaults(func=cmd_profile)

    from .tune import TUNES

    tunable = "; ".join(f"{m}: {what}" for m, what in TUNES.items())
    t = sub.add_parser("tune", help=f"search a method's configuration ({tunable})")
    t.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="bundled name, local HF directory, .gguf file or hub id (or give it as --model)")
    t.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as for every other command (the same as the positional MODEL)")
    t.add_argument("--method", default=next(iter(TUNES)), help=f"method to tune ({', '.join(TUNES)})")
    t.add_argument("--objective", default="speed", choices=["speed", "proxy"],
                   help="speed: measured decode tokens/s (default, the paper's); proxy: teacher-forced agreement "
                        "with a measured cost model (cheaper, deterministic)")
    t.add_argument("--trials", type=int, default=60, help="trials to complete, earlier runs included (default 60)")
    t.add_argument("--time-budget", type=float, default=None, help="stop starting trials after this many seconds")
    t.add_argument("--prompts", default=None, help="calibration JSONL (default: the built-in calibration set; "
                                                   "never use evaluation prompts)")
    t.add_argument("--calib-category", default=None, help="only calibration prompts of this category (code, chat)")
    t.add_argument("--calib-prompts", type=int, default=4, help="calibration prompts used (default 4)")
    t.add_argument("--calib-tokens", type=int, default=32, help="tokens per calibration prompt (default 32)")
    t.add_argument("--draft-exit", default="cost", choices=["cost", "gamma"], help="exit rule to tune for")
    t.add_argument("--rerank", type=int, default=0,
                   help="proxy: measure the speed of the best N proxy trials and keep the fastest")
    t.add_argument("--draft-kernels", default="same", choices=["same", "int8"],
                   help="kernels of the draft passes to search under (int8: a quantised copy of the weights, +25%% "
                        "memory; verification stays exact); stored in the skip config")
    t.add_argument("--draft-vocab", type=int, default=0,
                   help="reduced draft vocabulary size to search under (0 = full); stored in the skip config")
    t.add_argument("--seed", type=seed_arg, default=0, help="sampler seed")
    t.add_argument("--state", default=None, help="search state directory (resumed when it exists)")
    t.add_argument("--fresh", action="store_true", help="start over instead of resuming the search state")
    t.add_argument("--out", default=None,
                   help="skip config path (default: $SELFSPEC_HOME/skip_configs/MODEL.json, used automatically)")
    t.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto (CUDA if available)")
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--kernels", default=os.environ.get("SELFSPEC_KERNELS") or "auto", type=_kernels_arg(False),
                   help="tune on this linear-layer backend (use the one you will decode with; default auto)")
    t.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code (off by default)")
    t.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    t.set_defaults(func=cmd_tune)

    from .train.command import add_train_parser

    add_train_parser(sub)  # selfspec train OBJECTIVE: each objective's options (train/command.py)

    ex = sub.add_parser("export", help="export a trained draft head as the EAGLE draft vLLM, SGLang or EAGLE loads")
    ex.add_argument("head", metavar="HEAD",
                    help="a head directory (selfspec train hass), or eagle2 / hass: the model's installed head")
    ex.add_argument("--model", required=True, help="its target model (checks, and the embedding for EAGLE)")
    ex.add_argument("--engine", required=True, choices=["vllm", "sglang", "eagle"],
                    help="the loader to write for: vllm, sglang or eagle (SafeAILab EAGLE's cnets1.py)")
    ex.add_argument("--out", required=True, help="output directory")
    ex.add_argument("--dtype", choices=["fp16", "bf16"], default=None,
                    help="serving dtype of the weights (default: the target checkpoint's if bf16, else fp16)")
    ex.add_argument("--with-embeddings", action="store_true",
                    help="also write embed_tokens.weight (--engine eagle only; vLLM and SGLang use the target's)")
    ex.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code (off by default)")
    ex.set_defaults(func=cmd_export)

    sv = sub.add_parser("serve", help="an OpenAI-compatible server: /v1/chat/completions, /v1/completions, /metrics")
    from .serve.command import add_serve_args

    _add_model_args(sv)
    add_serve_args(sv)
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="measure methods and peers against ar on a prompt set")
    from .bench.runner import add_bench_args

    add_bench_args(b)
    _add_model_args(b, method=False, many=True)
    b.set_defaults(func=cmd_bench)
    for action in sub._choices_actions:  # each command's --help starts with what it does, as train's do
        command = sub.choices[action.dest]
        if command.description is None:
            command.description = action.help
    for action in msub._choices_actions:
        if msub.choices[action.dest].description is None:
            msub.choices[action.dest].description = action.help
    return p


def _resume_hint(args: argparse.Namespace | None) -> str:
    """How to continue an interrupted command that keeps its progress (train, bench: --resume;
    tune: its --state), or nothing."""
    if args is None:
        return ""
    if hasattr(args, "resume"):  # train, bench: checkpoints / records in --out
        again = "run the same command again" if args.resume else "run the same command with --resume"
        return f"; {again} to continue from where it stopped (--out {args.out})"
    if getattr(args, "cmd", None) == "tune" and getattr(args, "state", None):
        return f"; run the same command again to continue the search (--state {args.state})"
    return ""


@contextlib.contextmanager
def _library_notes() -> Iterator[Callable[[bool], None]]:
    """While a command runs: the library's notes and warnings (``selfspec.*`` loggers: what
    ``auto`` measures and chooses, cost profiles, downloads, conversions) as ``selfspec: ...``
    lines on whatever ``sys.stderr`` is when the message comes (tests replace it), and not passed
    on to other handlers (no duplicates where something configured the root logger). Yields
    ``set_quiet(quiet)``: warnings only with ``-q``. Restored afterwards, so a program that calls
    ``main`` keeps its own ``logging`` set-up."""

    class Stderr(logging.StreamHandler):
        def emit(self, record: logging.LogRecord) -> None:
            self.stream = sys.stderr
            super().emit(record)

    logger = logging.getLogger("selfspec")
    saved = logger.level, logger.propagate
    handler = Stderr()
    handler.setFormatter(logging.Formatter("selfspec: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield lambda quiet: logger.setLevel(logging.WARNING if quiet else logging.INFO)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with _library_notes() as set_quiet:
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
        import contextlib

        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
