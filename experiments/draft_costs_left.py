"""What is left to cut from the compiled int8 draft step, and whether it can be cut (issue 34).

Two questions, each answered without a model forward:

1. **A reduced draft vocabulary** would shrink the draft's LM head (0.72 ms of a ~5 ms int8 draft
   step on SmolLM2: 28 MB of int8 rows) to its N most frequent tokens. A drafted token outside
   them can never be accepted, so the question is how often the target's own greedy output leaves
   them: the share of the ``ar`` token ids recorded by the SmolLM2 benchmark runs under
   ``docs/results`` (greedy, one record per prompt id) that fall inside the model's ranking's first
   N, and what that share means for a chain of k drafts (share^k: the chance that no token of a
   k-token run leaves the vocabulary, where the int8 draft itself agrees 85-98% a token).
2. **The attention call**: what ``selfspec::windowed_sdpa`` costs per call against the SDPA it
   wraps, on SmolLM2's one-token shapes (9 query heads, 3 KV heads, 64 dims, 512-position cache,
   60 written), one thread, best of rounds; how much of it a C++ operator could remove.

    python experiments/draft_costs_left.py [--model smollm2-135m-instruct] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from selfspec.bench.records import read_records, records_file

ROOT = Path(__file__).resolve().parents[1]


def ar_token_ids(model: str) -> list[int]:
    """Greedy ``ar`` token ids of every prompt id in the benchmark runs of ``model`` (first record each)."""
    ids: list[int] = []
    seen: set[str] = set()
    for meta in sorted((ROOT / "docs" / "results").glob("*/meta.json")):
        if json.loads(meta.read_text()).get("model") != model or records_file(meta.parent) is None:
            continue
        for r in read_records(meta.parent):
            if (r.get("method", "").split("@")[0] == "ar" and not r.get("temperature") and r.get("token_ids")
                    and r["prompt_id"] not in seen):
                seen.add(r["prompt_id"])
                ids.extend(r["token_ids"])
    return ids


def coverage(model: str) -> None:
    ranking = json.loads((ROOT / "src" / "selfspec" / "data" / "draft_vocab" / f"{model}.json").read_text())["ranking"]
    ids = ar_token_ids(model)
    if not ids:
        raise SystemExit(f"no greedy ar records of {model} under docs/results")
    print(f"{len(ids)} greedy ar tokens of {model} from docs/results")
    print("| draft vocabulary N | share of ar tokens inside | no token outside in a run of 8 | of 12 |")
    print("|---|---|---|---|")
    for n in (4096, 8192, 16384, 32768):
        top = set(ranking[:n])
        share = sum(i in top for i in ids) / len(ids)
        print(f"| {n} | {share:.3f} | {share ** 8:.2f} | {share ** 12:.2f} |")


def attention(rounds: int) -> None:
    import torch
    import torch.nn.functional as F

    import selfspec.kernels.gqa_attention as g

    torch.set_num_threads(1)
    q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 512, 64), torch.randn(1, 3, 512, 64)
    mask, window = torch.ones(1, 1, 1, 512, dtype=torch.bool), torch.tensor(60)
    ks, vs = k[:, :, :60].contiguous(), v[:, :, :60].contiguous()

    def us(f, n: int = 3000) -> float:
        for _ in range(200):
            f()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n * 1e6

    cases = {
        "the op (torch.ops.selfspec.windowed_sdpa)": lambda: torch.ops.selfspec.windowed_sdpa(q, k, v, mask, window,
                                                                                            None),
        "its Python function called directly": lambda: g.windowed_sdpa(q, k, v, mask, window, None),
        "SDPA on views of the first 60 positions": lambda: F.scaled_dot_product_attention(
            q, k[:, :, :60], v[:, :, :60], enable_gqa=True),
        "SDPA on contiguous 60-position tensors": lambda: F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True),
        "SDPA over all 512 positions, masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                      enable_gqa=True),
    }
    best = {name: min(us(f) for _ in range(rounds)) for name, f in cases.items()}
    print("| one-token attention call (1 thread) | us, best of rounds |")
    print("|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    coverage(a.model)
    print()
    attention(a.rounds)


if __name__ == "__main__":
    main()
