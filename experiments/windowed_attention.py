"""What does attending over the written cache positions only save in the compiled step? (issue 34)

The ``compiled`` backend's step attends through a mask as wide as its static cache's capacity (512
positions at least, 2048 for requests of 897-1,920 tokens). Since session 51 its attention is one
custom op that slices the cache to the positions written so far at run time
(``kernels/gqa_attention.py``, ``windowed_sdpa``). This times one step both ways in one process,
interleaved: the library's step, and the same step with the window keyword withheld (attention over
the whole capacity, the step before the change), each compiled into its own Inductor cache
directory (their saved steps share a name: the full-width one is compiled under ``--full-dir``).
Medians of ``--reps`` calls per (context, block, capacity).

    python experiments/windowed_attention.py --out docs/results/windowed-attention-avx512/run1.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import selfspec
from selfspec.core.machine import cpu_flags
from selfspec.models import compiled_step
from selfspec.models.compiled_step import StaticStep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--contexts", default="60,250")
    ap.add_argument("--blocks", default="1,2,4,8")
    ap.add_argument("--capacities", default="512,2048")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--full-dir", default="/tmp/selfspec-full-width-steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = selfspec.load(args.model, method="ar", kernels="compiled")
    model = g.target.model
    windowed, full = g.target.step, StaticStep(model)
    real_window = compiled_step.window_arg
    own_dir = compiled_step.compile_cache_dir()

    def run(step: StaticStep, cache, ids, pos, base: int) -> float:
        is_full = step is full
        compiled_step.window_arg = (lambda m, w: {}) if is_full else real_window
        os.environ[compiled_step.INDUCTOR_DIR] = args.full_dir if is_full else own_dir
        t = time.perf_counter()
        step.forward(cache, ids, pos, None, False, base=base)
        return time.perf_counter() - t

    rows = []
    with torch.inference_mode():
        for cap in (int(c) for c in args.capacities.split(",")):
            for base in (int(c) for c in args.contexts.split(",")):
                caches = {}
                for name, step in (("windowed", windowed), ("full", full)):
                    caches[name] = step.take_cache(cap)
                    compiled_step.window_arg = (lambda m, w: {}) if step is full else real_window
                    step.prefill(caches[name], torch.full((base,), 7), False)
                for q in (int(b) for b in args.blocks.split(",")):
                    ids, pos = torch.full((q,), 9), torch.arange(base, base + q)
                    times: dict[str, list[float]] = {"windowed": [], "full": []}
                    for i in range(args.reps + 5):
                        for name, step in (("windowed", windowed), ("full", full)):
                            dt = run(step, caches[name], ids, pos, base)
                            if i >= 5:  # the first calls compile or load the shape
                                times[name].append(dt)
                    w, f = (statistics.median(times[k]) * 1e3 for k in ("windowed", "full"))
                    rows.append({"capacity": cap, "context": base, "block": q, "windowed_ms": round(w, 3),
                                 "full_ms": round(f, 3), "ratio": round(w / f, 3)})
                    print(f"capacity {cap} context {base} block {q}: windowed {w:.2f} ms, full width {f:.2f} ms, "
                          f"ratio {w / f:.3f}", flush=True)
                for name, step in (("windowed", windowed), ("full", full)):
                    step.give_back(caches[name])
    compiled_step.window_arg = real_window
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"model": args.model, "machine": platform.processor() or platform.machine(),
                       "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
