"""Acceptance and draft cost against the draft vocabulary size N, per drafter (issue 21). Resumable.

For each drafter and N (0 = the full vocabulary) the script decodes the same prompts greedily
with a fixed draft shape, so acceptance is comparable across N (no cost-aware back-off):
``hass``/``eagle2`` with a fixed 24-node tree, ``self-spec`` with k = 4 drafts and the shipped skip
set (``self-spec-int8``: the same with int8 draft passes; ``self-spec-int8-noskip``: the whole
model in int8 as the draft). It records tau (tokens per verify
step), acceptance by depth, the draft seconds per drafted step and the tokens/s, checks every
output against ``ar``, and draws ``acceptance_vs_vocab.png``. Usage::

    python experiments/draft_vocab_sweep.py --model smollm2-135m-instruct --out docs/results/draft-vocab-smollm2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import selfspec
from selfspec.bench.datasets import humaneval, mt_bench
from selfspec.models.loading import load_model

DRAFTERS = {
    "hass": ("hass", dict(total_tokens=24, top_k=8, depth=5, min_prob=0.0)),
    "eagle2": ("eagle2", dict(total_tokens=24, top_k=8, depth=5, min_prob=0.0)),
    "self-spec": ("self-spec", dict(k=4, auto_k=False)),
    "self-spec-int8": ("self-spec", dict(k=4, auto_k=False, draft_kernels="int8")),
    # the whole model, int8, as the draft: no layer skipped
    "self-spec-int8-noskip": ("self-spec", dict(k=4, auto_k=False, draft_kernels="int8", skip_attention=(),
                                                skip_mlp=())),
}


def prompts(n: int) -> list[str]:
    """n/2 MT-bench and n/2 HumanEval prompts (chat and code), never calibration or training data."""
    return [p.text for p in mt_bench()[: n // 2]] + [p.text for p in humaneval()[: n - n // 2]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    ap.add_argument("--sizes", default="0,2048,4096,8192,16384")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rec_path = out / "records.jsonl"
    done = {(r["drafter"], r["size"]) for r in map(json.loads, rec_path.read_text().splitlines())} \
        if rec_path.is_file() else set()
    target = load_model(a.model, kernels=a.kernels)
    texts = prompts(a.prompts)
    ar = selfspec.load(target, "ar", self_test=False)
    refs = [ar.generate(t, max_new_tokens=a.max_new_tokens, chat=True) for t in texts]
    ar_tps = sum(r.new_tokens for r in refs) / sum(r.wall_s for r in refs)
    for name in a.drafters.split(","):
        method, opts = DRAFTERS[name]
        for size in (int(s) for s in a.sizes.split(",")):
            if (name, size) in done:
                continue
            g = selfspec.load(target, method, self_test=False, draft_vocab=size, **opts)
            rs = [g.generate(t, max_new_tokens=a.max_new_tokens, chat=True) for t in texts]
            same = sum(r.token_ids == ref.token_ids for r, ref in zip(rs, refs))
            steps = sum(r.steps - 1 for r in rs)  # decode steps (the prefill excluded)
            drafted = sum(sum(1 for d in r.drafted_per_step if d) for r in rs)
            depth = [sum(r.acceptance_by_depth[i] for r in rs if len(r.acceptance_by_depth) > i)
                     / max(sum(1 for r in rs if len(r.acceptance_by_depth) > i), 1) for i in range(5)]
            tps = sum(r.new_tokens for r in rs) / sum(r.wall_s for r in rs)
            rec = {"drafter": name, "size": size, "model": a.model, "kernels": target.backend,
                   "tau": sum(r.new_tokens - 1 for r in rs) / max(steps, 1), "acceptance_by_depth": depth,
                   "draft_ms_per_drafted_step": 1e3 * sum(r.draft_s for r in rs) / max(drafted, 1),
                   "verify_ms_per_step": 1e3 * sum(r.verify_s for r in rs) / max(steps, 1),
                   "tokens_per_s": tps, "ar_tokens_per_s": ar_tps, "speedup_vs_ar": tps / ar_tps,
                   "identical_to_ar": f"{same}/{len(rs)}", "prompts": len(rs), "max_new_tokens": a.max_new_tokens}
            print(json.dumps(rec), flush=True)
            with rec_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            del g
    plot(out)


def plot(out: Path) -> None:
    """``acceptance_vs_vocab.png``: tau and depth-1 acceptance against N per drafter and, when
    ``draft_breakdown.json`` (``experiments/draft_breakdown.py``, timed interleaved) lies beside the
    records, the draft cost in T(1) against N. The decode-time draft milliseconds of the records
    are not plotted: on a shared machine they move with its load, the interleaved timing does not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    cost_file = out / "draft_breakdown.json"
    cost = json.loads(cost_file.read_text())["in_T1"] if cost_file.is_file() else None
    fig, axes = plt.subplots(1, 3 if cost else 2, figsize=(14 if cost else 10, 4))
    for name in dict.fromkeys(r["drafter"] for r in recs):
        rows = sorted((r for r in recs if r["drafter"] == name), key=lambda r: r["size"] or 10**9)
        labels = [str(r["size"]) if r["size"] else "full" for r in rows]
        axes[0].plot(labels, [r["acceptance_by_depth"][0] for r in rows], marker="o", label=name)
        axes[1].plot(labels, [r["tau"] for r in rows], marker="o", label=name)
    axes[0].set_ylabel("acceptance at depth 1")
    axes[1].set_ylabel("tau (k = 4 chain / 24-node tree)")
    if cost:
        series: dict[str, dict[str, float]] = {}
        for k, v in cost.items():
            if k == "T(1)" or "N=" not in k:
                continue
            what, n = k.rsplit(", N=", 1)
            series.setdefault(what, {})[n] = v
        for what, pts in series.items():
            order = sorted(pts, key=lambda n: 10**9 if n == "full" else int(n))
            axes[2].plot(order, [pts[n] for n in order], marker="o", label=what)
        axes[2].set_ylabel("draft cost in T(1) (interleaved timing)")
        axes[2].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("draft vocabulary N")
    axes[0].legend()
    fig.suptitle(f"{recs[0]['model']}: reduced draft vocabularies (greedy, every output identical to ar)")
    fig.tight_layout()
    fig.savefig(out / "acceptance_vs_vocab.png", dpi=110)


if __name__ == "__main__":
    main()
