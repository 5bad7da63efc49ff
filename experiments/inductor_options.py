"""What does an Inductor option of the compiled step cost or save? (issue 34)

Times the compiled step of ``ar`` (one-token and ``--blocks`` blocks after ``--context`` written
positions, medians of ``--reps`` calls) in separate processes, alternating between the library's
options (``models/aot_step.py``, ``INDUCTOR_OPTIONS``) and the same options with ``--change``
applied (JSON, e.g. ``'{"size_asserts": true}'`` for the step as it was before session 51, or
``'{"cpp_wrapper": true}'``), each compiled into its own Inductor cache directory (the first round
compiles: minutes). The VM's speed drifts between rounds, so compare within a round.

    python experiments/inductor_options.py --change '{"size_asserts": true}' --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(change: dict, context: int, blocks: list[int], reps: int) -> None:
    """One process: time the step with the options changed by ``change``; print a JSON line."""
    import torch

    from selfspec.models import aot_step

    aot_step.INDUCTOR_OPTIONS = {**aot_step.INDUCTOR_OPTIONS, **change}
    import selfspec

    g = selfspec.load("smollm2-135m-instruct", method="ar", kernels="compiled")
    step = g.target.step
    out = {}
    with torch.inference_mode():
        for q in blocks:
            cache = step.take_cache(512)
            step.prefill(cache, torch.full((context,), 7), False)
            ts = []
            for _ in range(reps + 10):
                t = time.perf_counter()
                step.forward(cache, torch.full((q,), 9), torch.arange(context, context + q), None, False, base=context)
                ts.append(time.perf_counter() - t)
            step.give_back(cache)
            out[q] = round(statistics.median(ts[10:]) * 1e3, 3)
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--change", required=True, help="Inductor options to change, as JSON")
    ap.add_argument("--context", type=int, default=60)
    ap.add_argument("--blocks", default="1,8")
    ap.add_argument("--reps", type=int, default=70)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/selfspec-inductor-options", help="the changed steps' Inductor cache")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    if args.child is not None:
        child(json.loads(args.child), args.context, blocks, args.reps)
        return
    base = [sys.executable, __file__, "--change", args.change, "--context", str(args.context), "--blocks", args.blocks,
            "--reps", str(args.reps)]
    for r in range(args.rounds):
        runs = (("library", "{}", {}), ("changed", args.change, {"TORCHINDUCTOR_CACHE_DIR": args.dir}))
        for label, change, env in runs:
            res = subprocess.run(base + ["--child", change], capture_output=True, text=True, env={**os.environ, **env},
                                 check=True)
            times = json.loads(res.stdout.strip().splitlines()[-1])
            shown = ", ".join(f"T({q}) {ms:.2f} ms" for q, ms in times.items())
            print(f"round {r + 1} {label:8s} {shown}", flush=True)


if __name__ == "__main__":
    main()
