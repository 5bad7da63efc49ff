"""Where one decoding step of a model spends its time, per kernels backend.

Runs ``--method`` on the first ``--prompts`` built-in prompts twice: once plainly (wall time per
step) and once under ``torch.profiler`` (self CPU time per operator, grouped). "Python and
framework" is the plain wall time minus the operators' time: the interpreter, HF module calls,
our loop and drafter. Usage::

    python experiments/step_breakdown.py --model smollm2-135m-instruct --kernels stock,onednn,int8
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

import selfspec
from selfspec.bench.datasets import builtin

GROUPS = {
    "matrix kernels": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::_int_mm",
                       "onednn::qlinear_pointwise"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                  "aten::_softmax", "aten::scaled_dot_product_attention"),
    "cache and masks": ("aten::cat", "aten::index_select", "aten::index", "aten::slice", "aten::narrow",
                        "aten::copy_", "aten::ones", "aten::masked_fill", "aten::nonzero", "aten::arange",
                        "aten::expand", "aten::_to_copy", "aten::to"),
}


def group_of(name: str) -> str:
    for g, names in GROUPS.items():
        if name in names:
            return g
    return "other ops (norms, rotary, activations, quantisation)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="pld")
    ap.add_argument("--kernels", default="stock,onednn,int8")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    args = ap.parse_args()

    target = None
    rows = {}
    prompts = [p.text for p in builtin()[: args.prompts]]
    for backend in args.kernels.split(","):
        g = selfspec.load(target or args.model, args.method, kernels=backend)
        target = g.target
        g.generate(prompts[0], max_new_tokens=8)  # warm-up
        t0 = time.perf_counter()
        steps = sum(g.generate(p, max_new_tokens=args.max_new_tokens).steps for p in prompts)
        wall = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for p in prompts:
                g.generate(p, max_new_tokens=args.max_new_tokens)
        groups: dict[str, float] = {}
        for e in prof.key_averages():
            groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total / 1e6
        ops = sum(groups.values())
        ms = {k: 1000 * v / steps for k, v in sorted(groups.items())}
        ms["Python and framework"] = max(0.0, 1000 * (wall - ops) / steps)
        rows[backend] = {"ms_per_step": 1000 * wall / steps, "parts_ms": ms, "steps": steps}
        print(f"\n{args.model} {args.method} on {backend}: {1000 * wall / steps:.1f} ms per step ({steps} steps)")
        for k, v in sorted(ms.items(), key=lambda kv: -kv[1]):
            print(f"  {k:55s} {v:7.2f} ms  {100 * v / (1000 * wall / steps):5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
