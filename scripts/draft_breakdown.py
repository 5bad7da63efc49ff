"""Where EAGLE-2/HASS drafting spends its time per tree level, on the real model (issue 21:
per-level overhead and the reduced draft vocabulary).

For each ``--draft-vocab`` size: the hass drafter expands its full tree (depth 5, top-k 10, no
early stop) from the same context ``--reps`` times, plainly (wall ms per level) and under
``torch.profiler`` (self CPU ms per level by operator group; "Python and framework" is the wall
time minus the operators'). Usage::

    python scripts/draft_breakdown.py --model smollm2-135m-instruct --draft-vocab 0,8192 --out FILE.json
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

GROUPS = {
    "LM head and other matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise",
                                  "aten::_int_mm", "onednn::qlinear_pointwise", "aten::linear", "aten::matmul"),
    "softmax and top-k": ("aten::_log_softmax", "aten::log_softmax", "aten::topk", "aten::_softmax",
                          "aten::softmax", "aten::exp", "aten::sort"),
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
    d.cache, d.length, d.features = kv_cache.new_cache(d.head.config), 0, feats
    h_last = d.catch_up(ids)
    t0 = time.perf_counter()
    pool = d.expand(h_last, d.length)
    dt = time.perf_counter() - t0
    kv_cache.truncate(d.cache, d.length)
    levels = 1 + (pool.scores.numel() - d.cfg.top_k) // (d.cfg.top_k ** 2)
    return dt, levels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft-vocab", default="0,8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    results: dict = {"model": a.model, "hass": {}}
    prompt = builtin()[0].text
    for size in (int(s) for s in a.draft_vocab.split(",")):
        g = selfspec.load(a.model, "hass", total_tokens=60, top_k=10, depth=5, min_prob=0.0, draft_vocab=size,
                          self_test=False)
        ids = list(encode_prompt(g.tokenizer, prompt, True, g.target.model.config.vocab_size))
        with torch.no_grad():
            feats = g.target.model.model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
        d = g.drafter
        for _ in range(3):
            expand_once(d, ids, feats)
        walls, levels = [], 1
        for _ in range(a.reps):
            dt, levels = expand_once(d, ids, feats)
            walls.append(dt)
        wall = statistics.median(walls)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(a.reps):
                expand_once(d, ids, feats)
        # catch-up is outside the timed expansion but inside the profile: subtract it by timing it alone
        with profile(activities=[ProfilerActivity.CPU]) as prof_cu:
            for _ in range(a.reps):
                d.cache, d.length, d.features = kv_cache.new_cache(d.head.config), 0, feats
                d.catch_up(ids)
        groups: dict[str, float] = {}
        for p, sign in ((prof, 1.0), (prof_cu, -1.0)):
            for e in p.key_averages():  # self times: every microsecond counted once
                groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + sign * e.self_cpu_time_total / 1e3
        per_level = {k: round(v / a.reps / levels, 3) for k, v in groups.items()}
        ops = sum(groups.values()) / a.reps
        per_level["Python and framework"] = round(max(wall * 1e3 - ops, 0.0) / levels, 3)
        results["hass"][str(size)] = {"expansion_ms": round(wall * 1e3, 2), "levels": levels,
                                      "ms_per_level": round(wall * 1e3 / levels, 3), "per_level_ms": per_level}
        print(f"hass draft_vocab={size}: expansion {wall * 1e3:.1f} ms over {levels} levels "
              f"({wall * 1e3 / levels:.2f} ms/level): {per_level}", flush=True)
        del g, d
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
