"""Does training under bf16 autocast follow fp32's losses (issue 32, item 2)? Compares the
histories of two ``selfspec train`` runs with the same data, seed and options, one with
``--mixed-precision no`` and one with ``auto`` (bf16 where the CPU has bf16 units and a timed pass
is faster in it, logged by the run), step by step.

    selfspec train msn --model smollm2-135m-instruct --out FP32 --data sharegpt-answers:150,code:240 \\
        --regenerate 0 --max-len 256 --span 4 --max-steps 100 --lora-rank 8 --batch-size 4 --mixed-precision no
    selfspec train msn ... --out AUTO --mixed-precision auto      # the same options otherwise
    python experiments/bf16_loss_match.py FP32 AUTO [--out DIR]   # DIR: report.md + both histories
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics as st
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fp32", type=Path, help="output directory of the fp32 run")
    ap.add_argument("other", type=Path, help="output directory of the bf16 (or auto) run")
    ap.add_argument("--out", type=Path, default=None, help="write report.md and both histories here")
    args = ap.parse_args()
    runs = [json.loads((d / "train" / "history.json").read_text()) for d in (args.fp32, args.other)]
    la, lb = ([h["loss"] for h in r["history"]] for r in runs)
    n = min(len(la), len(lb))
    la, lb = la[:n], lb[:n]
    diff = [b - a for a, b in zip(la, lb)]
    rel = [abs(b - a) / a for a, b in zip(la, lb)]
    noise = st.median(abs(la[i + 1] - la[i]) for i in range(n - 1))
    lines = [f"# bf16 autocast against fp32: {n} training steps, the same data, seed and options", "",
             f"- fp32: `{args.fp32}`; other: `{args.other}`",
             f"- per-step loss difference (other - fp32): mean {st.mean(diff):+.4f}, median |d| "
             f"{st.median(abs(d) for d in diff):.4f}, largest |d| {max(abs(d) for d in diff):.4f} nats; relative: "
             f"median {st.median(rel):.2%}, largest {max(rel):.2%}",
             f"- step-to-step change of the fp32 loss (the noise a difference is measured against): median "
             f"{noise:.4f} nats", "", "| steps | fp32 loss | other loss |", "|---|---|---|"]
    width = max(1, n // 4)
    for lo in range(0, n, width):
        lines.append(f"| {lo + 1}-{min(lo + width, n)} | {st.mean(la[lo:lo + width]):.4f} | "
                     f"{st.mean(lb[lo:lo + width]):.4f} |")
    vals = [r["val"][-1] if r["val"] else {} for r in runs]
    keys = [k for k in ("loss", "plain", "acc1", "acc2", "acc3") if all(k in v for v in vals)]
    if keys:
        lines += ["", f"Held-out at step {vals[0].get('step')}:", "", "| | " + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 1) + "|"]
        for name, v in zip(("fp32", "other"), vals):
            lines.append(f"| {name} | " + " | ".join(f"{v[k]:.4f}" for k in keys) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(report)
        for name, d in (("fp32", args.fp32), ("other", args.other)):
            shutil.copy(d / "train" / "history.json", args.out / f"{name}-history.json")


if __name__ == "__main__":
    main()
