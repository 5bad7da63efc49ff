"""What a compiled, static-shape decode step would buy on this CPU (issue 34), before building it.

Times ``transformers`` ``generate`` greedily on the bundled SmolLM2 (fp32) three ways, interleaved,
best of ``--repeats`` each: eager with the dynamic cache (what ``ar`` runs today), eager with the
static cache, and ``torch.compile(model.forward)`` with the static cache (Inductor, one shape: the
one-token decode step). Reports tok/s, the compile time, and whether the token ids are identical
to eager. Writes ``--out`` JSON.

    python experiments/compile_probe.py --threads 2 --tokens 64 --out docs/results/compile-probe-avx2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.core.machine import cpu_flags
    from selfspec.models import bundled

    path = str(bundled.pull(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    msgs = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    gen = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=tok.eos_token_id)

    def run(static: bool) -> tuple[float, list[int]]:
        kw = dict(gen, cache_implementation="static") if static else gen
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kw)
        return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()

    eager_forward = model.forward
    compiled_forward = torch.compile(model.forward, dynamic=False, fullgraph=False)
    t0 = time.perf_counter()
    model.forward = compiled_forward
    _, _ = run(True)  # compiles the prefill and the decode step
    compile_s = time.perf_counter() - t0
    print(f"compile_probe: compiled in {compile_s:.0f} s", file=sys.stderr)
    best: dict[str, float] = {}
    ids_of: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, fwd, static in (("eager", eager_forward, False), ("eager-static", eager_forward, True),
                                  ("compiled-static", compiled_forward, True)):
            model.forward = fwd
            s, out = run(static)
            best[name] = min(best.get(name, float("inf")), s)
            ids_of[name] = out
    res = {"command": " ".join(sys.argv), "cpu_flags": cpu_flags(), "threads": args.threads, "torch": torch.__version__,
           "tokens": args.tokens, "compile_s": compile_s,
           "tok_per_s": {k: args.tokens / v for k, v in best.items()},
           "identical_to_eager": {k: ids_of[k] == ids_of["eager"] for k in ids_of}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
