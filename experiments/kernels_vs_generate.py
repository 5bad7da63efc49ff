"""Where greedy ids of ``ar`` on a kernels backend differ from ``transformers`` ``generate`` (fp32, stock).

Reads the records of ``experiments/bench_kernels_vs_generate.sh`` (one bench run per dataset with
``ar@<kernels>`` and the ``hf`` peer; the backend is read from each run's ``meta.json``), and for
every prompt whose ids differ finds the first differing position and the gap between the two
largest logits there, on both backends (a near-tie that rounding flips, or a real difference).
Writes ``differences.json`` and ``differences.md`` into the output directory.

    python experiments/kernels_vs_generate.py docs/results/onednn-vs-generate
    python experiments/kernels_vs_generate.py docs/results/compiled-vs-generate-avx2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from selfspec.bench.datasets import load_dataset
from selfspec.bench.records import read_records, records_file
from selfspec.core import kv_cache
from selfspec.decoding.text import encode_prompt
from selfspec.models.compiled_step import capacity_for
from selfspec.models.loading import LoadedModel, load_model


@torch.inference_mode()
def top2(target: LoadedModel, ids: list[int]) -> tuple[float, int, int]:
    """(gap between the two largest logits, top-1 id, top-2 id) after ``ids`` on the model's
    current backend; on ``compiled``, the prefix is prefilled on a static cache and the last
    token runs through the compiled one-token step, as in decoding."""
    if target.step is not None:
        cache = kv_cache.new_cache(target.model.config, capacity_for(len(ids)))
        target.step.prefill(cache, torch.tensor(ids[:-1]), False)
        n = len(ids) - 1
        logits = target.step.forward(cache, torch.tensor(ids[-1:]), torch.tensor([n]), None, False).logits[-1]
    else:
        logits = target.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
    v, i = torch.topk(logits, 2)
    return float(v[0] - v[1]), int(i[0]), int(i[1])


def main(out: Path) -> None:
    rows, totals, kernels = [], {}, None
    for ds_dir in sorted(p for p in out.iterdir() if p.is_dir() and records_file(p) is not None):
        meta = json.loads((ds_dir / "meta.json").read_text())
        kernels = meta["kernels"][0]
        prompts = {p.id: p for p in load_dataset(meta["dataset"], None, 1, None)}
        recs = read_records(ds_dir)
        ar = {r["prompt_id"]: r["token_ids"] for r in recs if r["method"] == f"ar@{kernels}" and r["repeat"] == 0}
        hf = {r["prompt_id"]: r["token_ids"] for r in recs if r["method"] == "hf" and r["repeat"] == 0}
        both = sorted(set(ar) & set(hf))
        totals[meta["dataset"]] = {"prompts": len(both), "identical": sum(ar[p] == hf[p] for p in both),
                                   "tokens": sum(len(hf[p]) for p in both)}
        diffs = [p for p in both if ar[p] != hf[p]]
        if not diffs:
            continue
        stock, other = load_model(meta["model"], kernels="stock"), load_model(meta["model"], kernels=kernels)
        for pid in diffs:
            a, h = ar[pid], hf[pid]
            pos = next((i for i, (x, y) in enumerate(zip(a, h)) if x != y), min(len(a), len(h)))
            p = prompts[pid]
            ctx = encode_prompt(stock.tokenizer, p.text, p.chat, stock.model.config.vocab_size) + h[:pos]
            gap_stock, t1, t2 = top2(stock, ctx)
            gap_other, o1, o2 = top2(other, ctx)
            rows.append({"dataset": meta["dataset"], "prompt_id": pid, "position": pos, "new_tokens": len(h),
                         "stock_top2_gap": gap_stock, "stock_top": [t1, t2], f"{kernels}_top2_gap": gap_other,
                         f"{kernels}_top": [o1, o2]})
    (out / "differences.json").write_text(json.dumps({"kernels": kernels, "totals": totals, "differences": rows},
                                                     indent=1))
    lines = [f"# `ar` on {kernels} kernels vs `transformers` `generate` (fp32, stock), greedy, 128 tokens", "",
             "| dataset | prompts | ids identical | differ |", "|---|---|---|---|"]
    for ds, t in totals.items():
        lines.append(f"| {ds} | {t['prompts']} | {t['identical']} | {t['prompts'] - t['identical']} |")
    lines += ["", "At each difference: the first differing position (0 = first generated token) and the gap "
              "between the two largest logits there, on each backend (stock picks the first id, "
              f"{kernels} the second of its pair when they flip).", "",
              f"| dataset | prompt | position | top-2 gap (stock) | top-2 gap ({kernels}) "
              f"| top ids stock / {kernels} |",
              "|---|---|---|---|---|---|"]
    if not rows:
        lines.append("| (none: every prompt's ids are identical) | | | | | |")
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['prompt_id']} | {r['position']} | {r['stock_top2_gap']:.2e} | "
                     f"{r[f'{kernels}_top2_gap']:.2e} | {r['stock_top']} / {r[f'{kernels}_top']} |")
    (out / "differences.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/onednn-vs-generate"))
