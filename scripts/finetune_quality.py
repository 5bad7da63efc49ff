"""Quality cost of a selfspec fine-tune (sdsat, and later space / msn) against its base model:

* perplexity of held-back text the fine-tune never saw: HumanEval's canonical programs (code) and
  ShareGPT conversations outside every training slice (chat), with the teacher-forced top-1
  agreement of the fine-tuned model's predictions with the base model's;
* agreement of greedy outputs: the base and the fine-tuned model each answer the first turn of
  MT-bench questions (chat template, ``ar``); identical answers, and the mean length of the common
  prefix.

Writes JSON (and prints a table).

    python scripts/finetune_quality.py --base smollm2-135m-instruct --model smollm2-135m-instruct-sdsat \
        --out docs/results/sdsat-quality.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

import selfspec
from selfspec.bench import datasets
from selfspec.bench.perplexity import heldback_code, perplexity
from selfspec.models.loading import load_model
from selfspec.train.conversations import load_sharegpt


def heldback_chat(limit: int, tokenizer) -> list[str]:
    """ShareGPT conversations at positions 2000.. of the seed-42 shuffle (training takes the first
    224 of it and the first 150+ of the seed-43 shuffle; those ids are removed too), rendered
    with the chat template."""
    used = {c.id for c in load_sharegpt(600, 43)}
    convs = [c for c in load_sharegpt(2000 + 4 * limit, 42)[2000:] if c.id not in used][:limit]
    out = []
    for c in convs:
        msgs = [{"role": r, "content": t[:1500]} for r, t in c.messages[:2]]
        out.append(tokenizer.apply_chat_template(msgs, tokenize=False))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="smollm2-135m-instruct")
    ap.add_argument("--model", default="smollm2-135m-instruct-sdsat")
    ap.add_argument("--code", type=int, default=40, help="HumanEval programs for perplexity")
    ap.add_argument("--chat", type=int, default=30, help="held-back ShareGPT conversations for perplexity")
    ap.add_argument("--prompts", type=int, default=24, help="MT-bench questions for greedy agreement")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    base, tuned = load_model(args.base), load_model(args.model)
    sets = {"code (HumanEval canonical)": heldback_code(args.code),
            "chat (held-back ShareGPT)": heldback_chat(args.chat, base.tokenizer)}
    result: dict = {"base": args.base, "model": args.model, "perplexity": {}, "greedy": {}}
    for name, texts in sets.items():
        b, ref = perplexity(base.model, base.tokenizer, texts, desc=f"base {name}")
        t, _ = perplexity(tuned.model, tuned.tokenizer, texts, ref, desc=f"tuned {name}")
        result["perplexity"][name] = {"base": asdict(b), "tuned": asdict(t)}
        print(f"{name:28s} perplexity base {b.perplexity:.3f}  fine-tuned {t.perplexity:.3f} "
              f"({100 * (t.perplexity / b.perplexity - 1):+.1f}%)  top-1 agreement {t.top1_agree:.4f}  "
              f"({b.tokens} tokens)", flush=True)
    gb, gt = selfspec.load(base, "ar"), selfspec.load(tuned, "ar")
    qs = datasets.mt_bench()[: args.prompts]
    same, prefix, total = 0, 0, 0
    for q in qs:
        a = gb.generate(q.text, max_new_tokens=args.max_new_tokens).token_ids
        b = gt.generate(q.text, max_new_tokens=args.max_new_tokens).token_ids
        same += a == b
        prefix += common_prefix(a, b)
        total += len(a)
    result["greedy"] = {"prompts": len(qs), "max_new_tokens": args.max_new_tokens, "identical": same,
                        "mean_common_prefix": prefix / len(qs), "mean_base_length": total / len(qs)}
    print(f"greedy answers to {len(qs)} MT-bench questions: {same} identical; mean common prefix "
          f"{prefix / len(qs):.1f} of {total / len(qs):.1f} tokens", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
