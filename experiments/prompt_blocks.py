"""The compiled backend's prompt forward: through the step in padded blocks of 64 tokens
(``StaticStep.prefill``) against one eager forward (``StaticStep._eager_prefill``), interleaved
request by request in one process on the built-in prompts; whole-request seconds, the prompt
forward's median, and whether the ids agree (docs/performance.md, "The prompt through the compiled
step").

    python experiments/prompt_blocks.py --method ar
    python experiments/prompt_blocks.py --method self-spec --rounds 2
"""

from __future__ import annotations

import argparse
import statistics

import torch

import selfspec
from selfspec.bench import datasets
from selfspec.models.compiled_step import MIN_CAPACITY, StaticStep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ar")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    g = selfspec.load("smollm2-135m-instruct", method=args.method, kernels="compiled", self_test=False)
    assert g.target.step is not None
    g.target.step.warm_up(MIN_CAPACITY, (1, 2, 4, 8, 16, 32, 64), g.drafter.needs_hidden)
    paths = {"blocks": StaticStep.prefill,
             "eager": lambda self, cache, ids, hidden: self._eager_prefill(cache, ids, hidden)}
    prompts = [p.text for p in datasets.builtin()]
    g.generate(prompts[0], max_new_tokens=8)
    wall: dict[str, list[float]] = {k: [] for k in paths}
    prompt_s: dict[str, list[float]] = {k: [] for k in paths}
    ids: dict[tuple[str, int], list[int]] = {}
    try:
        for rnd in range(args.rounds):
            for i, text in enumerate(prompts):
                order = list(paths) if (i + rnd) % 2 == 0 else list(paths)[::-1]
                for name in order:
                    StaticStep.prefill = paths[name]  # this process only
                    r = g.generate(text, max_new_tokens=args.max_new_tokens)
                    wall[name].append(r.wall_s)
                    prompt_s[name].append(r.prefill_s)
                    ids.setdefault((name, i), r.token_ids)
    finally:
        StaticStep.prefill = paths["blocks"]
    total = {k: sum(v) for k, v in wall.items()}
    same = sum(ids[("blocks", i)] == ids[("eager", i)] for i in range(len(prompts)))
    print(f"{args.method}: all requests {total['eager']:.2f} s eager, {total['blocks']:.2f} s in blocks "
          f"({total['eager'] / total['blocks']:.3f}x); prompt forward median "
          f"{statistics.median(prompt_s['eager']) * 1e3:.1f} -> {statistics.median(prompt_s['blocks']) * 1e3:.1f} ms; "
          f"ids identical {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
