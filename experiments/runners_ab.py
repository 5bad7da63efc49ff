"""Issue 57 (runners): two questions about one checkout's ``src`` against another's.

``--case threads``: do two generators over one loaded model (``ar`` on oneDNN, ``self-spec`` on stock
kernels built from the first's ``target``), decoding at once in two threads, give the ids of their solo
runs? (At 286ffbe: 4 of 8; with runners: 8 of 8.)

``--case speed``: one process's tok/s of ``selfspec.load()`` (its cached choice) and of ``ar``, ``pld`` and
``self-spec`` (int8 drafts) on oneDNN over the same loaded model, 6 built-in chat prompts x 64 tokens,
greedy, interleaved prompt by prompt after a warm-up, with a hash of each configuration's ids.

Run each case for both checkouts alternating, e.g. (one JSON line per process)::

    git worktree add /tmp/old 286ffbe
    python -c "from pathlib import Path; from tests.conftest import save_tiny; save_tiny(Path('/tmp/tiny'))"
    for src in /tmp/old/src src; do python experiments/runners_ab.py --src $src --case threads --tiny /tmp/tiny; done
    for rep in 1 2 3; do for src in /tmp/old/src src; do
        python experiments/runners_ab.py --src $src --case speed; done; done
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading


def threads_case(d: str) -> dict:
    import torch

    import selfspec

    def prompt_ids(seed: int, n: int) -> list[int]:
        return torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    torch.set_num_threads(1)
    g1 = selfspec.load(str(d), method="ar", kernels="onednn", self_test=False)
    g2 = selfspec.load(g1.target, method="self-spec", kernels="stock", self_test=False, skip_attention=(1,),
                       skip_mlp=(0,), k=3, auto_k=False)
    prompts = [prompt_ids(11, 9), prompt_ids(12, 14)]
    solo = [[g.generate(p, max_new_tokens=20, ignore_eos=True).token_ids for p in prompts] for g in (g1, g2)]
    together: dict = {}
    start = threading.Barrier(2)

    def work(i: int, g) -> None:
        torch.set_num_threads(1)
        start.wait()
        for r in range(2):
            for j, p in enumerate(prompts):
                together[(i, j, r)] = g.generate(p, max_new_tokens=20, ignore_eos=True).token_ids

    ts = [threading.Thread(target=work, args=(i, g)) for i, g in enumerate((g1, g2))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"identical_to_solo": sum(v == solo[i][j] for (i, j, _), v in together.items()), "of": len(together)}


def speed_case() -> dict:
    import selfspec
    from selfspec.bench.datasets import load_dataset
    from selfspec.decoding.text import encode_prompt

    d = selfspec.load()
    gens = {"default": d, "ar@onednn": selfspec.load(d.target, method="ar", kernels="onednn", self_test=False),
            "pld@onednn": selfspec.load(d.target, method="pld", kernels="onednn", self_test=False),
            "self-spec@onednn,int8": selfspec.load(d.target, method="self-spec", kernels="onednn", self_test=False,
                                                   draft_kernels="int8")}
    vocab = d.target.model.config.vocab_size
    ids = [encode_prompt(d.tokenizer, p.text, True, vocab) for p in load_dataset("builtin", limit=6)]
    for g in gens.values():
        g.generate(ids[0], max_new_tokens=16)
    tok, sec, out = dict.fromkeys(gens, 0), dict.fromkeys(gens, 0.0), {k: [] for k in gens}
    for x in ids:
        for k, g in gens.items():
            r = g.generate(x, max_new_tokens=64)
            tok[k] += r.new_tokens
            sec[k] += r.wall_s
            out[k].append(r.token_ids)
    return {"default": d.method, "tok_s": {k: round(tok[k] / sec[k], 2) for k in gens},
            "ids": {k: hashlib.sha256(json.dumps(v).encode()).hexdigest()[:12] for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True, help="the checkout's src directory whose selfspec to import")
    ap.add_argument("--case", choices=("threads", "speed"), required=True)
    ap.add_argument("--tiny", help="threads: the tests' tiny model directory (tests.conftest.save_tiny)")
    a = ap.parse_args()
    sys.path.insert(0, a.src)
    print(json.dumps({"src": a.src, **(threads_case(a.tiny) if a.case == "threads" else speed_case())}))


if __name__ == "__main__":
    main()
