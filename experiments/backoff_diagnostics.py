"""Why the trained methods back off (issue 32, item 1), measured on held-out prompts.

For each trained method on its SmolLM2 artefact (hass / eagle2 heads; sdsat, space, msn LoRA
fine-tunes), decode MT-bench and HumanEval prompts greedily three ways in one process, interleaved
prompt by prompt: ``ar``, the method at its defaults, and the method forced to draft every step
(no back-off, a fixed draft size). From the forced run it reports what drafting costs and buys:

* acceptance by depth and tau (tokens per drafted step);
* the draft cost and the verify cost of a step, in units of an ``ar`` step measured in place;
* the predicted speedup tau / (draft + verify) next to the measured one;
* the tau (tokens per step) that drafting would need to pay 1.0x and 1.2x at that cost;
* for the defaults run: the share of steps that drafted (the back-off decisions) and the speedup.

``python experiments/backoff_diagnostics.py --prompts 6 --out docs/results/backoff-diagnostics`` writes
``diagnostics.json`` and ``diagnostics.md``. Ids of every run are checked against ``ar``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import selfspec
from selfspec.bench.datasets import humaneval, mt_bench
from selfspec.core.machine import cpu_flags

CASES = {  # method -> (model, options that force drafting every step)
    "hass": ("smollm2-135m-instruct", {"backoff": False}),
    "eagle2": ("smollm2-135m-instruct", {"backoff": False}),
    "sdsat": ("smollm2-135m-instruct-sdsat", {"k": 3}),
    "space": ("smollm2-135m-instruct-space", {"k": 3}),
    "msn": ("smollm2-135m-instruct-msn", {"tree_size": 12}),
}


def decode_stats(results: list) -> dict:
    """Totals over prompts (the first token, which comes from the prompt forward, excluded)."""
    steps = sum(r.steps - 1 for r in results)
    tokens = sum(r.new_tokens - 1 for r in results)
    wall = sum(r.wall_s - r.prefill_s for r in results)
    drafted = sum(sum(1 for d in r.drafted_per_step[1:] if d > 0) for r in results)
    depth = max((len(r.acceptance_by_depth) for r in results), default=0)
    acc = []
    for j in range(depth):
        vals = [r.acceptance_by_depth[j] for r in results if len(r.acceptance_by_depth) > j]
        acc.append(round(statistics.mean(vals), 3) if vals else 0.0)
    return {"steps": steps, "tokens": tokens, "decode_s": wall, "tok_s": tokens / wall if wall else 0.0,
            "tau": tokens / steps if steps else 0.0, "drafted_share": drafted / steps if steps else 0.0,
            "draft_s_per_step": sum(r.draft_s for r in results) / steps if steps else 0.0,
            "verify_s_per_step": sum(r.verify_s for r in results) / steps if steps else 0.0,
            "acceptance_by_depth": acc}


def render(report: dict, max_new_tokens: int) -> list[str]:
    """The markdown table of a report (``diagnostics.json``)."""
    lines = [f"# Why the trained methods back off ({report['date']}, CPU flags {report['cpu_flags']})", "",
             f"`{report['command']}`: {report['prompts']} held-out prompts (MT-bench + HumanEval) x "
             f"{max_new_tokens} tokens, greedy, one process; costs in units of an `ar` step measured in place. "
             "Forced: drafting every step (no back-off, a fixed draft size). Acceptance by depth: accepted / "
             "verified nodes at that depth (trees verify several per depth).", "",
             "| method | default: x ar | default: steps drafted | forced: x ar | forced: tau | acceptance by depth "
             "| draft cost | verify cost | predicted x ar | tau needed for 1.0x / 1.2x | same ids as ar |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in report["methods"].items():
        d, f = r["default"], r["forced"]
        acc = ", ".join(f"{a:.2f}" for a in f["acceptance_by_depth"][:5])
        lines.append(f"| {m} | {d['speedup']} | {d['drafted_share']:.0%} | {f['speedup']} | {f['tau']} | {acc} | "
                     f"{f['draft_cost_T1']} | {f['verify_cost_T1']} | {f['predicted_speedup']} | "
                     f"{r['tau_for_1.0x']} / {r['tau_for_1.2x']} | {r['identical']['default']}+"
                     f"{r['identical']['forced']}/{2 * report['prompts']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=6, help="MT-bench and HumanEval prompts each (default 6)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", default=",".join(CASES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="backoff-diagnostics")
    p.add_argument("--render", action="store_true", help="only rewrite diagnostics.md from OUT/diagnostics.json")
    args = p.parse_args(argv)
    if args.render:
        report = json.loads((Path(args.out) / "diagnostics.json").read_text())
        (Path(args.out) / "diagnostics.md").write_text("\n".join(render(report, report["max_new_tokens"])) + "\n")
        return 0
    prompts = [q.text for q in mt_bench()[: args.prompts]] + [q.text for q in humaneval()[: args.prompts]]
    chats = [True] * args.prompts + [False] * args.prompts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "cpu_flags": cpu_flags(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                    "methods": {}}
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    extra: dict = {}
    for method in args.methods.split(","):
        model, forced_opts = CASES[method]
        print(f"[diag] {method} on {model} ...", file=sys.stderr, flush=True)
        ar = selfspec.load(model, "ar", **extra)
        default = selfspec.load(ar.target, method, **extra)
        forced = selfspec.load(ar.target, method, **forced_opts, **extra)
        runs: dict[str, list] = {"ar": [], "default": [], "forced": []}
        for gen in (ar, default, forced):  # warm-up
            gen.generate(prompts[0], max_new_tokens=8, chat=chats[0])
        for text, chat in zip(prompts, chats):
            for name, gen in (("ar", ar), ("default", default), ("forced", forced)):
                runs[name].append(gen.generate(text, max_new_tokens=args.max_new_tokens, chat=chat))
        ref = [r.token_ids for r in runs["ar"]]
        st = {name: decode_stats(rs) for name, rs in runs.items()}
        t1 = st["ar"]["decode_s"] / st["ar"]["steps"]  # an ar step in place (loop overhead included)
        f = st["forced"]
        step_cost = (f["draft_s_per_step"] + f["verify_s_per_step"]) / t1
        row = {
            "model": model, "kernels": ar.kernels, "forced_options": forced_opts,
            "identical": {n: sum(r.token_ids == g for r, g in zip(runs[n], ref)) for n in ("default", "forced")},
            "ar_step_ms": round(1e3 * t1, 2),
            "default": {"speedup": round(st["default"]["tok_s"] / st["ar"]["tok_s"], 3),
                        "tau": round(st["default"]["tau"], 3),
                        "drafted_share": round(st["default"]["drafted_share"], 3)},
            "forced": {"speedup": round(f["tok_s"] / st["ar"]["tok_s"], 3), "tau": round(f["tau"], 3),
                       "acceptance_by_depth": f["acceptance_by_depth"],
                       "draft_cost_T1": round(f["draft_s_per_step"] / t1, 3),
                       "verify_cost_T1": round(f["verify_s_per_step"] / t1, 3),
                       "predicted_speedup": round(f["tau"] / step_cost, 3) if step_cost else None},
            "tau_for_1.0x": round(step_cost, 3), "tau_for_1.2x": round(1.2 * step_cost, 3),
        }
        report["methods"][method] = row
        print(f"[diag] {method}: {json.dumps(row)}", file=sys.stderr, flush=True)
        (out / "diagnostics.json").write_text(json.dumps(report, indent=1) + "\n")
        ar = default = forced = None
    lines = render(report, args.max_new_tokens)
    (out / "diagnostics.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
