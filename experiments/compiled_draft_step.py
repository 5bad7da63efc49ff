"""What would a whole-model draft cost through a compiled one-token step, and how often would it
be right? (issue 34, item 5: drafts through the compiled step)

The self-spec draft with the model's own weights quantised to int8 (no layer skipped) was the best
self-draft on oneDNN (acceptance 0.95 at depth 1, 1.48x `ar`: docs/results/self-spec-int8-smollm2-avx512),
but it runs eagerly, so Python and dispatch cost a large part of each draft token. Here every linear
layer of a copy of the model is replaced by a few-row product over the layout of
:mod:`selfspec.kernels.gemv` in the draft's precision (int8 with a per-output-row scale, bf16, or fp32
as the control), and the copy's forward is compiled on a 512-position static cache, as the
``compiled`` backend compiles the verify step. For each precision it reports:

- the compiled one-token step's median time (after a 40-token prefix; ``--reps`` calls), with
  the fp32 copy as the reference: the draft's cost in T(1) is the ratio of the two;
- the draft's agreement with the fp32 model's greedy continuation, teacher-forced (the fraction of
  positions where the draft's argmax is the next token ``generate`` chose): the depth-1 acceptance
  a chain draft would see, roughly.

This is a measurement of the pieces, not a decoder: the library's draft still runs eagerly.

    python experiments/compiled_draft_step.py --kinds int8,fp32,bf16 --out docs/results/compiled-draft-step-avx512.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from torch import nn

from selfspec.core import kv_cache
from selfspec.core.machine import cpu_flags
from selfspec.kernels import gemv
from selfspec.models.compiled_step import padded_mask
from selfspec.models.loading import load_model

PROMPTS = ("Write a short poem about the sea.", "Explain how a hash map works.", "def fibonacci(n):",
           "List three uses of copper.", "What causes rain?", "Give me a recipe for pancakes.",
           "Summarise the plot of Hamlet in two sentences.", "How do vaccines work?")


class DraftLinear(nn.Module):
    """``y = x @ W.T`` with ``W`` in the draft's precision: inside a compiled graph, blocks of up
    to ``gemv.ROWS`` rows are reductions over the blocked layout (weights converted to fp32 as
    they are read, int8 rows multiplied by their scale after the sum); eagerly, a product with
    the dequantised weight (the teacher-forced agreement). Shapes: ``x[..., K] -> y[..., N]``."""

    def __init__(self, lin: nn.Linear, kind: str) -> None:
        super().__init__()
        w = lin.weight.detach().float()
        self.kind, self.n = kind, w.shape[0]
        self.bias = None if lin.bias is None else lin.bias.detach()
        if kind == "int8":
            scale = w.abs().amax(1).clamp_min(1e-12) / 127
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.wb, self.scale, self.deq = gemv.blocked(q), scale, q.float() * scale[:, None]
        elif kind == "bf16":
            self.wb, self.scale, self.deq = gemv.blocked(w.bfloat16()), None, w.bfloat16().float()
        else:
            self.wb, self.scale, self.deq = gemv.blocked(w), None, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if self.wb is not None and torch.compiler.is_compiling() and gemv.takes(x2.shape[0]):
            nb, k, b = self.wb.shape
            rows = [(self.wb.float() * x2[m].reshape(1, k, 1)).sum(1).reshape(1, nb * b) for m in range(x2.shape[0])]
            y = torch.cat(rows, 0) if len(rows) > 1 else rows[0]
            y = y * self.scale if self.scale is not None else y
        else:
            y = x2 @ self.deq.T
        y = y if self.bias is None else y + self.bias
        return y.reshape(*lead, self.n)


def to_draft(model: nn.Module, kind: str) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` (the LM head included) replaced in place by :class:`DraftLinear`."""
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                setattr(mod, name, DraftLinear(child, kind))
    return model


@torch.inference_mode()
def step_time(model: nn.Module, reps: int, prefix: int = 40, capacity: int = 512) -> tuple[float, float, float]:
    """(median, min, first-call) seconds of the compiled one-token step after ``prefix`` cached positions."""
    cpu, attn = torch.device("cpu"), model.config._attn_implementation
    cache = kv_cache.new_cache(model.config, capacity)
    model(input_ids=torch.full((1, prefix), 5), position_ids=torch.arange(prefix)[None],
          attention_mask=padded_mask(0, None, prefix, prefix, capacity, attn, model.dtype, cpu),
          **kv_cache.cache_arg(model, cache), use_cache=True)
    step = torch.compile(model.forward, dynamic=False, options={"realize_reads_threshold": 1})
    kw = dict(input_ids=torch.full((1, 1), 7), position_ids=torch.tensor([[prefix]]),
              attention_mask=padded_mask(prefix, None, 1, 1, capacity, attn, model.dtype, cpu),
              **kv_cache.cache_arg(model, cache), use_cache=True)
    t0 = time.perf_counter()
    step(**kw)
    first = time.perf_counter() - t0
    step(**kw)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step(**kw)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], times[0], first


@torch.inference_mode()
def agreement(model: nn.Module, refs: list[tuple[int, torch.Tensor]]) -> tuple[int, int]:
    """(positions where ``model``'s argmax is the reference's next token, positions)."""
    hit = total = 0
    for n, seq in refs:
        pred = model(seq[None]).logits[0, n - 1:-1].argmax(-1)
        hit += int((pred == seq[n:]).sum())
        total += seq.numel() - n
    return hit, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kinds", default="int8,fp32,bf16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ref = load_model(args.model, kernels="stock")
    refs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = ref.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)["input_ids"]
            refs.append((ids.shape[1], ref.model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0]))
    del ref
    rows = {}
    for kind in args.kinds.split(","):
        model = to_draft(load_model(args.model, kernels="stock").model, kind)
        hit, total = agreement(model, refs)
        med, low, first = step_time(model, args.reps)
        rows[kind] = {"agreement": hit / total, "positions": total, "t1_median_ms": med * 1e3, "t1_min_ms": low * 1e3,
                      "first_call_s": first}
        print(f"{kind}: agreement with fp32 greedy {hit}/{total} = {hit / total:.3f}; compiled one-token step "
              f"median {med * 1e3:.2f} ms (min {low * 1e3:.2f}; first call {first:.0f} s)", flush=True)
        del model
    if "fp32" in rows:
        for kind, r in rows.items():
            r["cost_in_fp32_t1"] = r["t1_median_ms"] / rows["fp32"]["t1_median_ms"]
            print(f"{kind}: {r['cost_in_fp32_t1']:.2f} x the fp32 copy's T(1)")
    if args.out:
        meta = {"model": args.model, "cpu": platform.processor() or platform.machine(), "flags": cpu_flags(),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "layout_block": gemv.BLOCK,
                "prompts": len(PROMPTS), "new_tokens": args.new_tokens, "reps": args.reps}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "kinds": rows}, f, indent=1)


if __name__ == "__main__":
    main()
