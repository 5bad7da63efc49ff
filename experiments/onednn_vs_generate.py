"""Where greedy ids of ``ar`` on oneDNN kernels differ from ``transformers`` ``generate`` (fp32, stock).

Reads the records of ``experiments/bench_onednn_vs_generate.sh`` (one bench run per dataset with
``ar@onednn`` and the ``hf`` peer), and for every prompt whose ids differ finds the first
differing position and the gap between the two largest logits there, on both backends (a
near-tie that rounding flips, or a real difference). Writes ``differences.json`` and
``differences.md`` into the output directory.

    python experiments/onednn_vs_generate.py docs/results/onednn-vs-generate
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from selfspec.bench.datasets import load_dataset
from selfspec.decoding.text import encode_prompt
from selfspec.models.loading import load_model


@torch.inference_mode()
def top2(model: torch.nn.Module, ids: list[int]) -> tuple[float, int, int]:
    """(gap between the two largest logits, top-1 id, top-2 id) after ``ids``."""
    logits = model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
    v, i = torch.topk(logits, 2)
    return float(v[0] - v[1]), int(i[0]), int(i[1])


def main(out: Path) -> None:
    target = load_model("smollm2-135m-instruct", kernels="stock")
    rows, totals = [], {}
    for ds_dir in sorted(p for p in out.iterdir() if (p / "records.jsonl").is_file()):
        meta = json.loads((ds_dir / "meta.json").read_text())
        prompts = {p.id: p for p in load_dataset(meta["dataset"], None, 1, None)}
        recs = [json.loads(line) for line in (ds_dir / "records.jsonl").read_text().splitlines() if line.strip()]
        ar = {r["prompt_id"]: r["token_ids"] for r in recs if r["method"] == "ar@onednn" and r["repeat"] == 0}
        hf = {r["prompt_id"]: r["token_ids"] for r in recs if r["method"] == "hf" and r["repeat"] == 0}
        both = sorted(set(ar) & set(hf))
        totals[meta["dataset"]] = {"prompts": len(both), "identical": sum(ar[p] == hf[p] for p in both),
                                   "tokens": sum(len(hf[p]) for p in both)}
        for pid in both:
            a, h = ar[pid], hf[pid]
            if a == h:
                continue
            pos = next((i for i, (x, y) in enumerate(zip(a, h)) if x != y), min(len(a), len(h)))
            p = prompts[pid]
            ctx = encode_prompt(target.tokenizer, p.text, p.chat, target.model.config.vocab_size) + h[:pos]
            target.use_kernels("stock", keep=True)
            gap_stock, t1, t2 = top2(target.model, ctx)
            target.use_kernels("onednn", keep=True)
            gap_onednn, o1, o2 = top2(target.model, ctx)
            rows.append({"dataset": meta["dataset"], "prompt_id": pid, "position": pos, "new_tokens": len(h),
                         "stock_top2_gap": gap_stock, "stock_top": [t1, t2], "onednn_top2_gap": gap_onednn,
                         "onednn_top": [o1, o2]})
    (out / "differences.json").write_text(json.dumps({"totals": totals, "differences": rows}, indent=1))
    lines = ["# `ar` on onednn kernels vs `transformers` `generate` (fp32, stock), greedy, 128 tokens", "",
             "| dataset | prompts | ids identical | differ |", "|---|---|---|---|"]
    for ds, t in totals.items():
        lines.append(f"| {ds} | {t['prompts']} | {t['identical']} | {t['prompts'] - t['identical']} |")
    lines += ["", "At each difference: the first differing position (0 = first generated token) and the gap "
              "between the two largest logits there, on each backend (stock picks the first id, onednn the "
              "second of its pair when they flip).", "",
              "| dataset | prompt | position | top-2 gap (stock) | top-2 gap (onednn) | top ids stock / onednn |",
              "|---|---|---|---|---|---|"]
    if not rows:
        lines.append("| (none: every prompt's ids are identical) | | | | | |")
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['prompt_id']} | {r['position']} | {r['stock_top2_gap']:.2e} | "
                     f"{r['onednn_top2_gap']:.2e} | {r['stock_top']} / {r['onednn_top']} |")
    (out / "differences.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/onednn-vs-generate"))
