"""How well a self-spec draft's confidence predicts acceptance (why the budget calibrates it).

For each prompt the fp32 target writes ``--max-new-tokens`` greedy tokens; the draft (the model
with its shipped skip config's draft: by default the whole model on int8 weights) then reads the
same text teacher-forced, and each position gives (the draft's top-1 probability, whether its
top-1 token is the target's). Printed and written per confidence band and prompt set.

    python experiments/confidence_calibration.py --model smollm2-135m-instruct --datasets mt-bench,humaneval \\
        --limit 10 --out docs/results/confidence-calibration/smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

EDGES = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)


def main() -> None:
    from selfspec.bench.datasets import load_dataset
    from selfspec.kernels.switch import DraftLayers
    from selfspec.models.loading import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--kernels", default="onednn", help="the target's (verify) kernels")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = load_model(a.model, kernels=a.kernels)
    model, tok = m.model, m.tokenizer
    draft = DraftLayers(model, "int8").model  # the int8 draft's module tree
    result = {"model": a.model, "draft": "whole model, int8 weights", "kernels": a.kernels, "sets": {}}
    for ds in a.datasets.split(","):
        counts = [[0, 0] for _ in EDGES[:-1]]  # [accepted, drafted] per band
        for p in load_dataset(ds, limit=a.limit):
            text = (tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                            add_generation_prompt=True) if p.chat else p.text)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False)
                logits = draft(out).logits[0]
            for t in range(ids.shape[1] - 1, out.shape[1] - 1):
                q = logits[t].softmax(-1)
                x = int(q.argmax())
                band = max(i for i in range(len(EDGES) - 1) if EDGES[i] <= float(q[x]))
                counts[band][0] += int(x == int(out[0, t + 1]))
                counts[band][1] += 1
        rows = [{"confidence": [EDGES[i], min(EDGES[i + 1], 1.0)], "drafts": n, "accepted": (k / n if n else None)}
                for i, (k, n) in enumerate(counts)]
        total = sum(n for _, n in counts)
        result["sets"][ds] = {"agreement": sum(k for k, _ in counts) / max(total, 1), "bands": rows}
        print(f"{ds}: agreement {result['sets'][ds]['agreement']:.3f}")
        for r in rows:
            if r["drafts"]:
                print(f"  confidence {r['confidence'][0]:.2f}-{r['confidence'][1]:.2f}: {r['drafts']:4d} drafts, "
                      f"accepted {r['accepted']:.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
