"""What drafting costs, in units of one plain decoding step T(1), on the real model (issue 21).

Everything is timed interleaved (one repetition of each configuration in turn), so a shared,
drifting machine hits all alike; medians are reported:

- ``T(1)``: a one-token forward of the full model after the prompt (the verify backend).
- ``hass`` per tree level, for each ``--draft-vocab`` size: the expansion of a full tree
  (depth 5, top-k 10, no early stop) divided by its levels; and, under ``torch.profiler``, the
  self CPU time per level by operator group ("Python and framework" = wall minus operators).
- ``self-spec`` per draft token: one draft forward with the shipped skip set, for each draft
  vocabulary size, on the verify kernels and on an int8 copy (``--draft-kernels int8``), and the
  whole model in int8 (no skip).

Usage::

    python experiments/draft_breakdown.py --model smollm2-135m-instruct --draft-vocab 0,4096,8192 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import selfspec
from selfspec.bench.datasets import builtin
from selfspec.core import kv_cache
from selfspec.decoding.text import encode_prompt
from selfspec.drafters.skip_draft import draft_forward
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model
from selfspec.models.skipping import SkipSet, skipped

GROUPS = {
    "matmuls (LM head, head layer)": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise",
                                      "aten::_int_mm", "onednn::qlinear_pointwise", "aten::linear",
                                      "aten::matmul"),
    "softmax and top-k": ("aten::_log_softmax", "aten::log_softmax", "aten::topk", "aten::_softmax",
                          "aten::softmax", "aten::exp", "aten::sort", "aten::logsumexp"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                  "aten::scaled_dot_product_attention"),
    "masks, indexing, copies": ("aten::cat", "aten::index_select", "aten::index", "aten::slice", "aten::narrow",
                                "aten::copy_", "aten::ones", "aten::eye", "aten::masked_fill", "aten::nonzero",
                                "aten::arange", "aten::expand", "aten::_to_copy", "aten::to", "aten::full",
                                "aten::repeat_interleave", "aten::flatten", "aten::embedding", "aten::fill_",
                                "aten::index_copy_", "aten::zeros", "aten::empty"),
}


def group_of(name: str) -> str:
    for g, names in GROUPS.items():
        if name in names:
            return g
    return "other ops (norms, rotary, activations)"


def expand_once(d, ids: list[int], feats: torch.Tensor) -> tuple[float, int]:
    """Seconds of one full expansion (catch-up excluded) and its levels."""
    d.cache, d.length, d.features = kv_cache.new_cache(d.head.config), 0, feats
    h_last = d.catch_up(ids)
    t0 = time.perf_counter()
    pool = d.expand(h_last, d.length)
    dt = time.perf_counter() - t0
    kv_cache.truncate(d.cache, d.length)
    return dt, 1 + (pool.scores.numel() - d.cfg.top_k) // (d.cfg.top_k ** 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft-vocab", default="0,4096,8192")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    sizes = [int(s) for s in a.draft_vocab.split(",")]
    target = load_model(a.model, kernels="auto")
    model = target.model
    ids = list(encode_prompt(target.tokenizer, builtin()[0].text, True, model.config.vocab_size))
    with torch.no_grad():
        feats = model.model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
    hass = {}
    for n in sizes:
        try:
            hass[n] = selfspec.load(target, "hass", total_tokens=60, top_k=10, depth=5, min_prob=0.0, draft_vocab=n,
                                    self_test=False).drafter
        except SelfspecError as e:  # a model with no head: self-spec only
            print(f"hass: {e}", flush=True)
            break
    spec = {}
    for n in sizes:
        for kern in ("same", "int8"):
            spec[f"skip set, {kern} kernels, N={n or 'full'}"] = selfspec.load(
                target, "self-spec", draft_vocab=n, draft_kernels=kern, self_test=False).drafter
    spec["no skip, int8 kernels, N=full"] = selfspec.load(target, "self-spec", draft_vocab=0, draft_kernels="int8",
                                                          skip_attention=(), skip_mlp=(), self_test=False).drafter
    cache = kv_cache.new_cache(model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:-1]]), **kv_cache.cache_arg(model, cache), use_cache=True,
              logits_to_keep=1)
    base = len(ids) - 1

    def one_token(d=None) -> float:
        draft = d.draft_model if d is not None else skipped(model, SkipSet())
        with torch.no_grad():
            t0 = time.perf_counter()
            draft_forward(draft, cache, [ids[-1]], base, lm_head=None if d is None else d.lm_head)
            dt = time.perf_counter() - t0
        kv_cache.truncate(cache, base)
        return dt

    times: dict[str, list[float]] = {"T(1)": []}
    levels = 1
    with torch.no_grad():
        for r in range(a.reps + 2):
            keep = r >= 2  # two warm-up rounds
            t1 = one_token()
            for n, d in hass.items():
                dt, levels = expand_once(d, ids, feats)
                if keep:
                    times.setdefault(f"hass level, N={n or 'full'}", []).append(dt / levels)
            for name, d in spec.items():
                dt = one_token(d)
                if keep:
                    times.setdefault(f"self-spec token, {name}", []).append(dt)
            if keep:
                times["T(1)"].append(t1)
    med = {k: statistics.median(v) for k, v in times.items()}
    t1 = med["T(1)"]
    result = {"model": a.model, "kernels": target.backend, "reps": a.reps, "T1_ms": round(t1 * 1e3, 2),
              "ms": {k: round(v * 1e3, 2) for k, v in med.items()},
              "in_T1": {k: round(v / t1, 3) for k, v in med.items()}, "hass_levels": levels,
              "int8_draft_extra_bytes": next(iter(d.layers.extra_bytes for d in spec.values() if d.layers))}
    for k in med:
        print(f"{k:55s} {med[k] * 1e3:8.2f} ms  {med[k] / t1:6.3f} T(1)", flush=True)
    # where a hass level's time goes, per draft vocabulary size
    result["hass_level_breakdown_ms"] = {}
    for n, d in hass.items():
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            walls = [expand_once(d, ids, feats)[0] for _ in range(5)]
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof_cu:
            for _ in range(5):
                d.cache, d.length, d.features = kv_cache.new_cache(d.head.config), 0, feats
                d.catch_up(ids)
        groups: dict[str, float] = {}
        for p, sign in ((prof, 1.0), (prof_cu, -1.0)):  # the expansion's operators: all minus catch-up's
            for e in p.key_averages():
                groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + sign * e.self_cpu_time_total / 1e3
        per_level = {k: round(max(v, 0.0) / 5 / levels, 3) for k, v in groups.items()}
        per_level["Python and framework"] = round(max(sum(walls) * 1e3 - sum(groups.values()), 0.0) / 5 / levels, 3)
        result["hass_level_breakdown_ms"][str(n)] = per_level
        print(f"hass level breakdown N={n or 'full'}: {per_level}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
