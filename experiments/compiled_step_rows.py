"""SmolLM2's compiled step: is a one-token step's row the first row of a two-token block, and
what does a block of T tokens cost (median of 20 steps after a 12-token prompt)?

    python experiments/compiled_step_rows.py                      # T(1), T(2)
    python experiments/compiled_step_rows.py --sizes 1,2,4,8 --layout-rows 1

``--layout-rows R`` computes blocks of up to R tokens on the few-row layout (kernels/gemv.py)
instead of the default ``gemv.ROWS``, for comparing the two in separate processes; steps not
saved for that setting are compiled (about a minute each).
"""

from __future__ import annotations

import argparse
import time

import torch

from selfspec.kernels import gemv
from selfspec.models import aot_step
from selfspec.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2")
    rows = getattr(gemv, "ROWS", 1)  # 1 in trees older than the few-row product (a baseline on PYTHONPATH)
    ap.add_argument("--layout-rows", type=int, default=rows)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.layout_rows != rows:  # a comparison in this process only
        gemv.ROWS = args.layout_rows
        aot_step.PRODUCT_LAYOUT = gemv.layout(args.layout_rows)
    t = load_model("smollm2-135m-instruct", kernels="compiled")
    step = t.step
    ids = torch.tensor(t.tokenizer("The quick brown fox jumps over the lazy dog, and then")["input_ids"])
    n = len(ids)
    sizes = [int(s) for s in args.sizes.split(",")]
    with torch.inference_mode():
        cache = step.take_cache(512)
        step.prefill(cache, ids, False)
        a = step.forward(cache, torch.tensor([11]), torch.tensor([n]), None, False, base=n).logits
        b = step.forward(cache, torch.tensor([11, 22]), torch.tensor([n, n + 1]), None, False, base=n).logits
        print(f"T(1) row equal to the T(2) block's first row: {torch.equal(a[0], b[0])} "
              f"(largest difference {(a[0] - b[0]).abs().max().item():.3g})")
        med = {}
        for p in sizes:
            toks, pos = torch.tensor([11] * p), torch.arange(n, n + p)
            step.forward(cache, toks, pos, None, False, base=n)  # compiles or loads the step
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step.forward(cache, toks, pos, None, False, base=n)
                times.append(time.perf_counter() - t0)
            times.sort()
            med[p] = times[len(times) // 2]
            print(f"T({p}) median {med[p] * 1e3:.1f} ms, min {times[0] * 1e3:.1f} ms, "
                  f"T({p})/T({sizes[0]}) {med[p] / med[sizes[0]]:.2f}", flush=True)


if __name__ == "__main__":
    main()
