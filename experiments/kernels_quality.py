"""Quality cost of each kernels backend against the stock fp32 model: perplexity of held-back
code (HumanEval's canonical programs) and top-1 agreement with fp32. Writes JSON.

    python experiments/kernels_quality.py --model qwen2.5-coder-1.5b-instruct --out docs/results/kernels-quality.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

from selfspec.bench.perplexity import heldback_code, perplexity
from selfspec.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--kernels", default="stock,onednn,int8")
    ap.add_argument("--limit", type=int, default=40, help="first N HumanEval programs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    target = load_model(args.model)
    texts = heldback_code(args.limit)
    results, ref = {}, None
    for backend in args.kernels.split(","):
        res, preds = perplexity(target.runner(backend).model, target.tokenizer, texts, ref, desc=backend)
        if backend == "stock":
            ref = preds
        results[backend] = asdict(res)
        print(f"{backend:8s} perplexity {res.perplexity:.4f}  tokens {res.tokens}  top-1 agreement with stock "
              f"{res.top1_agree if res.top1_agree is not None else '-'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            from selfspec.core.machine import cpu_flags
            from selfspec.kernels.int8 import activation_bits, cpu_int8_path

            json.dump({"model": args.model, "texts": len(texts), "backends": results, "cpu_flags": cpu_flags(),
                       "int8_kernel": cpu_int8_path()[0], "int8_activation_bits": activation_bits("cpu")}, f,
                      indent=1)


if __name__ == "__main__":
    main()
