"""Where a verify step's time goes on a GPU (issue 31 follow-up), in one short device call.

1. The Llama-3.1-8B shape (bf16, synthetic weights as in ``scripts/gpu_check.py``): ``ar`` and an
   oracle chain (p = 0.8, k = 16) under ``torch.profiler``; prints the host-time table of each and
   the per-step split the loop records (draft / verify+accept).
2. The same layer shape with few layers (``--layers``, default 4): eager against the compiled
   static-shape step with CUDA graphs, ``ar`` and the oracle chain; ids compared
   (``gpu_check.compiled_speed``, which the GPU check's speed section runs too).

    PYTHONPATH=src:scripts python experiments/gpu_step_profile.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from gpu_check import SHAPES, SMALL_SHAPES, compiled_speed, loaded, make_model  # noqa: E402


def profile_case(gen, prompt: list[int], n: int, label: str, out: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    gen.generate(prompt, max_new_tokens=n, ignore_eos=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        r = gen.generate(prompt, max_new_tokens=n, ignore_eos=True)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    (out / f"profile_{label}.txt").write_text(table)
    print(f"== {label}: {r.steps} steps\n{table}", flush=True)
    r = gen.generate(prompt, max_new_tokens=n, ignore_eos=True)
    steps = max(1, r.steps - 1)
    return {"steps": r.steps, "decode_ms_per_step": round(1e3 * (r.wall_s - r.prefill_s) / steps, 3),
            "draft_ms_per_step": round(1e3 * r.draft_s / steps, 3),
            "verify_ms_per_step": round(1e3 * r.verify_s / steps, 3)}


def main() -> int:
    import selfspec
    from selfspec.drafters.scripted import ScriptedDrafter

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu-profile-out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=4, help="layers of the eager-vs-compiled model (0: skip it)")
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("--shape", default="llama-3.1-8b", help="a gpu_check shape (tiny-llama: the CPU dry run)")
    p.add_argument("--max-new", type=int, default=128)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    report: dict = {}
    path = out / ("step_profile.json" if not args.skip_profile else "step_compiled.json")
    shape = dict({**SHAPES, **SMALL_SHAPES}[args.shape], tie_word_embeddings=False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, shape["vocab_size"], (64,), generator=g).tolist()
    if not args.skip_profile:
        model = make_model(shape, args.device, dtype, seed=0, synthetic=True)
        target = loaded(model, args.shape)
        ar = selfspec.load(target, "ar", self_test=False)
        ref = ar.generate(prompt, max_new_tokens=64, ignore_eos=True).token_ids
        report["ar"] = profile_case(ar, prompt, 64, "ar", out)
        ar.drafter = ScriptedDrafter(ref, 16, 0, shape["vocab_size"], tree=False, accept_prob=0.8, seed=0)
        report["chain"] = profile_case(ar, prompt, 64, "chain", out)
        print(json.dumps(report), flush=True)
        path.write_text(json.dumps(report, indent=1))
        target = model = ar = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.layers <= 0:
        return 0
    ns = argparse.Namespace(device=args.device, small=False, compiled_layers=args.layers,
                            checkpoint=lambda: path.write_text(json.dumps(report, indent=1)))
    report["few_layers"] = compiled_speed(ns, shape, dtype, prompt, args.max_new, 3)
    ns.checkpoint()
    print(json.dumps(report["few_layers"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
