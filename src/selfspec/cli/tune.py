"""``selfspec tune``: search a method's configuration (self-spec's skip set) on calibration prompts."""

from __future__ import annotations

import argparse
import os

from ..config import seed_arg, threads_arg
from ..errors import SelfspecError
from .common import THREADS_HELP, check_device, kernels_arg


def add_parser(sub) -> None:
    """Register ``selfspec tune`` on the subcommand set ``sub``."""
    from ..tune import TUNES

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
    t.add_argument("--kernels", default=os.environ.get("SELFSPEC_KERNELS") or "auto", type=kernels_arg(False),
                   help="tune on this linear-layer backend (use the one you will decode with; default auto)")
    t.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code (off by default)")
    t.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Search the method's configuration on calibration prompts and write it where load finds it."""
    from ..models.loading import load_model
    from ..tune import TUNERS, TuneOptions

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
    check_device(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target = load_model(args.model, args.device, args.dtype, args.trust_remote_code,
                        kernels="stock" if args.kernels == "auto" else args.kernels)
    if args.kernels == "auto":  # the fastest fp32 runner by a quick timing, cached
        from ..autoselect.kernels import fastest_runner

        target = fastest_runner(target.base)
    cfg, path = TUNERS[args.method](target, opts)
    s = cfg.search
    what = (f"measured {s.get('tokens_per_s', 0):.1f} tok/s, {s.get('speedup', 0):.2f}x ar" if args.objective == "speed"
            else f"predicted {s['score']:.2f}x ar, top-1 agreement {s['top1_agreement']:.2f}"
            + (f", measured {s['measured_speedup']:.2f}x" if "measured_speedup" in s else ""))
    print(f"skip {len(cfg.skip_attention)} attention + {len(cfg.skip_mlp)} MLP of {2 * cfg.num_layers} sub-layers "
          f"(attention {list(cfg.skip_attention)}, MLP {list(cfg.skip_mlp)}); {what}; {s['trials']} trials")
    print(f"skip config: {path}")
    from ..tune.self_spec import SLOWER_FILE

    if path.name == SLOWER_FILE and not args.out:
        print(f"not installed: it measured {s.get('speedup', s.get('measured_speedup', 0)):.2f}x ar, slower than "
              f"plain decoding, so --method self-spec keeps its current config; try more --trials, or use it anyway "
              f"with --skip-config {path}")
    return 0
