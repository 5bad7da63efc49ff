"""EAGLE vs HASS ablation for one target: both heads evaluated on the same held-out features
(teacher-forced agreement at drafting steps 1..n, via the HCA forward) and their benchmark runs
(tau, speedup, acceptance by depth). Writes ablation.md, ablation.json and acceptance_by_depth.png.

    python experiments/hass_ablation.py --heads ~/.cache/selfspec/heads --model smollm2-135m-instruct \
        --bench docs/results/smollm2-hass-mt-bench ... --out docs/results/hass-ablation
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch


def held_out_agreement(heads: Path, model: str, passes: int, out_dir: Path) -> dict:
    from selfspec.heads.eagle import load_head
    from selfspec.models.loading import load_model
    from selfspec.train.features import read_sequences
    from selfspec.train.hca import HcaModel
    from selfspec.train.trainer import TrainOptions, evaluate

    target = load_model(model)
    seqs = list(read_sequences(heads / f"{model}-features"))
    opts = TrainOptions(passes=passes)
    val = seqs[len(seqs) - max(1, int(len(seqs) * opts.val_fraction)):]
    out = {}
    for name in ("stage1", "eagle2", "hass"):
        d = heads / f"{model}-{name}"
        if not (d / "model.safetensors").is_file():
            continue
        head, meta = load_head(d, target.model)
        m = evaluate(HcaModel(head, passes), target.model, val, replace(opts, objective=name), batch_size=4)
        out[name] = {"acc": [m[f"acc{j}"] for j in range(1, passes + 1)], "tokens": m["tokens"],
                     "steps": meta.get("steps"), "options": meta.get("options", {})}
        shutil.copy(d / "train" / "loss.png", out_dir / f"training_{name}.png")
    return out


def bench_rows(dirs: list[Path]) -> list[dict]:
    rows = []
    for d in dirs:
        rep = d / "report.json"
        if not rep.is_file():
            continue
        r = json.loads(rep.read_text())
        meta = r["meta"]
        for key, s in r["summary"].items():
            if s.get("kind") != "method":
                continue
            rows.append({"run": d.name, "method": key, "tau": s["tau"], "speedup": s["speedup"],
                         "tok_s": s["tokens_per_s"], "acceptance_by_depth": s["acceptance_by_depth"],
                         "identical": s.get("identical"), "draft_share": s.get("draft_share"),
                         "temperature": meta.get("generation", {}).get("temperature", 0.0)})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted({r["run"] for r in rows})
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for r in rows:
            if r["run"] == run and r["acceptance_by_depth"]:
                acc = r["acceptance_by_depth"]
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['method']} (tau {r['tau']:.2f})")
        ax.set_title(run)
        ax.set_xlabel("draft depth")
        ax.set_ylabel("acceptance rate at depth")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--heads", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--bench", type=Path, nargs="*", default=[])
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    agree = held_out_agreement(args.heads, args.model, args.passes, args.out)
    rows = bench_rows(args.bench)
    (args.out / "ablation.json").write_text(json.dumps({"held_out": agree, "bench": rows}, indent=1) + "\n")
    lines = ["# EAGLE vs HASS objectives (same features, same start, same extra epochs)", "",
             "## Held-out top-1 agreement with the target at drafting step j (teacher-forced tokens)", "",
             "| head | " + " | ".join(f"step {j}" for j in range(1, args.passes + 1)) + " | training steps |",
             "|---|" + "---|" * (args.passes + 1)]
    for name, a in agree.items():
        lines.append(f"| {name} | " + " | ".join(f"{x:.3f}" for x in a["acc"]) + f" | {a['steps']} |")
    lines += ["", "## Benchmark (greedy unless T says otherwise)", "",
              "| run | method | T | tau | speedup vs ar | tok/s | acceptance by depth | identical to ar |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " ".join(f"{x:.2f}" for x in r["acceptance_by_depth"])
        lines.append(f"| {r['run']} | {r['method']} | {r['temperature']} | {r['tau']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['tok_s']:.2f} | {acc} | {r['identical'] or ''} |")
    (args.out / "ablation.md").write_text("\n".join(lines) + "\n")
    if rows:
        plot(rows, args.out / "acceptance_by_depth.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
