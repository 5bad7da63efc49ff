"""``selfspec profile``: measure (or show the cached) verify cost curve T(q)."""

from __future__ import annotations

import argparse

from ..errors import SelfspecError
from .common import add_model_args, kernels_label, setup


def add_parser(sub) -> None:
    """Register ``selfspec profile`` on the subcommand set ``sub``."""
    pr = sub.add_parser("profile", help="measure the verify cost curve T(q) on this machine (drafters use it)")
    add_model_args(pr, method=False, method_flags=False)
    pr.add_argument("--max-q", type=int, default=64,
                    help="largest block size measured (default 64; a cached profile that stops short of it is "
                         "measured again)")
    pr.add_argument("--reps", type=int, default=5,
                    help="interleaved rounds (at least 3 are run); medians are reported (default 5)")
    pr.add_argument("--remeasure", action="store_true", help="measure again even if a profile is cached")
    pr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure (or show the cached) verify cost curve T(q) that drafters size their drafts from:
    the medians of interleaved repeats (raw) and their non-decreasing fit, which drafters use."""
    from ..core import cost
    from ..models.loading import load_model

    setup(args)
    if args.max_q < 1 or args.reps < 1:
        raise SelfspecError("--max-q and --reps must be at least 1")
    target = load_model(args.model, args.device, args.dtype, args.trust_remote_code,
                        kernels="stock" if args.kernels == "auto" else args.kernels)
    if args.kernels == "auto":  # the fastest fp32 runner by a quick timing, cached
        from ..autoselect.kernels import fastest_runner

        target = fastest_runner(target.base)
    key = target.cost_key
    qs = tuple(q for q in cost.PROFILE_QS if q < args.max_q) + (args.max_q,)
    # a cache that stops short of --max-q, or has drifted, is measured again (with the qs it had)
    prof, measured = cost.cached_or_measure(target.model, key, qs, remeasure=args.remeasure, max_q=args.max_q,
                                            reps=args.reps, progress=True, what=args.model, step=target.step)
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
