"""Issue 58, first part: aggregate tok/s of ``generate_batch`` against the same prompts one after the
other, on SmolLM2-135M fp32 (built-in chat prompts, greedy, one process; the two interleaved over
``--repeats``), with each request's identity to its solo run.

    python experiments/batch_throughput.py --method pld --kernels onednn --batch 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ar")
    ap.add_argument("--kernels", default="onednn")
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    import selfspec
    from selfspec.bench.datasets import load_dataset
    from selfspec.decoding.text import encode_prompt

    g = selfspec.load("smollm2-135m-instruct", method=a.method, kernels=a.kernels, measure=False)
    vocab = g.target.model.config.vocab_size
    sizes = [int(x) for x in a.batch.split(",")]
    ids = [encode_prompt(g.tokenizer, p.text, True, vocab) for p in load_dataset("builtin", limit=max(sizes))]
    g.generate(ids[0], max_new_tokens=8)
    solo = {}
    for i, x in enumerate(ids):
        solo[i] = g.generate(x, max_new_tokens=a.tokens, ignore_eos=True).token_ids
    rows = []
    for n in sizes:
        seq_s, bat_s, same = [], [], True
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for x in ids[:n]:
                g.generate(x, max_new_tokens=a.tokens, ignore_eos=True)
            seq_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = g.generate_batch(ids[:n], max_new_tokens=a.tokens, ignore_eos=True)
            bat_s.append(time.perf_counter() - t0)
            same &= all(r.token_ids == solo[i] for i, r in enumerate(out))
        tok = n * a.tokens
        rows.append({"requests": n, "sequential_tok_s": round(tok / statistics.median(seq_s), 2),
                     "batch_tok_s": round(tok / statistics.median(bat_s), 2),
                     "ratio": round(statistics.median(seq_s) / statistics.median(bat_s), 2),
                     "identical_to_solo": same, "mean_batch": round(statistics.mean(g.last_batch_sizes), 2)})
        print(json.dumps({"method": a.method, "kernels": a.kernels, **rows[-1]}), flush=True)


if __name__ == "__main__":
    main()
