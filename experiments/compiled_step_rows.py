"""SmolLM2's compiled step: is a one-token step's row the first row of a two-token block, and
what do T(1) and T(2) cost (median of 20 steps after a 12-token prompt)?

    python experiments/compiled_step_rows.py     # compiles the two steps the first time (~2 min)
"""

from __future__ import annotations

import time

import torch

from selfspec.models.loading import load_model


def main() -> None:
    torch.set_num_threads(2)
    t = load_model("smollm2-135m-instruct", kernels="compiled")
    step = t.step
    ids = torch.tensor(t.tokenizer("The quick brown fox jumps over the lazy dog, and then")["input_ids"])
    n = len(ids)
    with torch.inference_mode():
        cache = step.take_cache(512)
        step.prefill(cache, ids, False)
        a = step.forward(cache, torch.tensor([11]), torch.tensor([n]), None, False, base=n).logits
        b = step.forward(cache, torch.tensor([11, 22]), torch.tensor([n, n + 1]), None, False, base=n).logits
        print(f"T(1) row equal to the T(2) block's first row: {torch.equal(a[0], b[0])} "
              f"(largest difference {(a[0] - b[0]).abs().max().item():.3g})")
        for p in (1, 2):
            toks, pos = torch.tensor([11] * p), torch.arange(n, n + p)
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                step.forward(cache, toks, pos, None, False, base=n)
                times.append(time.perf_counter() - t0)
            times.sort()
            print(f"T({p}) median {times[10] * 1e3:.1f} ms, min {times[0] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
