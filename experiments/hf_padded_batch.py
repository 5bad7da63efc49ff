"""Issue 58's transformers peer: ``generate`` with a left-padded batch of the same chat prompts (greedy,
fp32, SmolLM2-135M, exactly ``--tokens`` new tokens each), aggregate tok/s at each batch size, and how
many rows' ids equal selfspec's solo ``ar`` ids of the same prompt (padding changes the masks and the
rows' shapes, so a row may differ where two tokens' logits nearly tie).

    python experiments/hf_padded_batch.py --batch 1,4,8 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    import torch

    import selfspec
    from selfspec.bench.datasets import load_dataset
    from selfspec.decoding.text import encode_prompt

    g = selfspec.load("smollm2-135m-instruct", method="ar", kernels="stock", measure=False)
    model, tok = g.target.base.model, g.tokenizer
    sizes = [int(x) for x in a.batch.split(",")]
    ids = [encode_prompt(tok, p.text, True, model.config.vocab_size) for p in load_dataset("builtin", limit=max(sizes))]
    solo = [g.generate(x, max_new_tokens=a.tokens, ignore_eos=True).token_ids for x in ids]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for n in sizes:
        width = max(len(x) for x in ids[:n])
        inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids[:n]])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids[:n]])
        with torch.inference_mode():
            model.generate(input_ids=inp[:, :8], attention_mask=mask[:, :8], max_new_tokens=4, do_sample=False)
            t0 = time.perf_counter()
            out = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=a.tokens,
                                 min_new_tokens=a.tokens, do_sample=False, pad_token_id=pad)
            wall = time.perf_counter() - t0
        same = sum(out[i, width:].tolist() == solo[i] for i in range(n))
        print(json.dumps({"peer": "transformers generate, padded batch (stock fp32)", "batch": n,
                          "tok_s": round(n * a.tokens / wall, 2), "rows_equal_to_selfspec_solo": f"{same}/{n}"}),
              flush=True)


if __name__ == "__main__":
    main()
