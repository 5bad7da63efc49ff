"""Acceptance and draft cost against the draft vocabulary size N, per drafter (issue 21). Resumable.

For each drafter and N (0 = the full vocabulary) the script decodes the same prompts greedily
with a fixed draft shape, so acceptance is comparable across N (no cost-aware back-off):
``hass``/``eagle2`` with a fixed 24-node tree, ``self-spec`` with k = 4 drafts and the shipped skip
set (``self-spec-int8``: the same with int8 draft passes; ``self-spec-int8-noskip``: the whole
model in int8 as the draft). It records tau (tokens per verify
step), acceptance by depth, the draft seconds per drafted step and the tokens/s, checks every
output against ``ar``, and draws ``acceptance_vs_vocab.png``. Usage::

    python scripts/draft_vocab_sweep.py --model smollm2-135m-instruct --out docs/results/draft-vocab-smollm2
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["drafter"] for r in recs):
        rows = sorted((r for r in recs if r["drafter"] == name), key=lambda r: r["size"] or 10**9)
        labels = [str(r["size"]) if r["size"] else "full" for r in rows]
        ax1.plot(range(len(rows)), [r["acceptance_by_depth"][0] for r in rows], marker="o", label=name)
        ax2.plot(range(len(rows)), [r["draft_ms_per_drafted_step"] for r in rows], marker="o", label=name)
        ax1.set_xticks(range(len(rows)), labels)
        ax2.set_xticks(range(len(rows)), labels)
    ax1.set_xlabel("draft vocabulary N")
    ax1.set_ylabel("acceptance at depth 1")
    ax2.set_xlabel("draft vocabulary N")
    ax2.set_ylabel("draft ms per drafted step")
    ax1.legend()
    ax1.set_title(f"{recs[0]['model']}: acceptance vs N")
    ax2.set_title("draft cost vs N")
    fig.tight_layout()
    fig.savefig(out / "acceptance_vs_vocab.png", dpi=110)


if __name__ == "__main__":
    main()
