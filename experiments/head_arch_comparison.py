"""EAGLE-2 against EAGLE-3 heads, EAGLE against HASS objective, at an equal training budget: the
table and plots of ``experiments/head_arch_comparison.sh``.

For each head (``HEADS/<arch>-<objective>``): its training budget (sequences, tokens, optimiser
steps, wall time), the held-out top-1 agreement with the target at each drafting step as its own
validation measured it, and from the benchmark runs: tau, speedup over ``ar``, acceptance by
depth and the share of wall time spent drafting, at default settings (cost-sized trees) and on a
fixed 24-node tree. Writes ``comparison.md``, ``comparison.json`` and ``acceptance_by_depth.png``.

    python experiments/head_arch_comparison.py --heads DIR --bench RUN_DIR [RUN_DIR ...] --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ARMS = ("eagle2-eagle", "eagle2-hass", "eagle3-eagle", "eagle3-hass")


def head_rows(heads: Path) -> dict[str, dict]:
    """Per arm: budget and validation agreement by drafting step, from ``selfspec_head.json``."""
    out = {}
    for arm in ARMS:
        f = heads / arm / "selfspec_head.json"
        if not f.is_file():
            continue
        meta = json.loads(f.read_text())
        val = meta.get("validation", {})
        acc = [val[k] for k in sorted((k for k in val if k.startswith("acc") and k[3:].isdigit()),
                                      key=lambda k: int(k[3:]))]
        hist = heads / arm / "train" / "history.json"
        wall = None
        if hist.is_file():
            secs = sorted(r.get("seconds", 0.0) for r in json.loads(hist.read_text()).get("history", []))
            wall = secs[len(secs) // 2] if secs else None  # median: robust to a paused or contended step
        o = meta.get("options", {})
        out[arm] = {"sequences": meta.get("sequences"), "tokens": meta.get("tokens"), "steps": meta.get("steps"),
                    "epochs": o.get("epochs"), "passes": o.get("passes", o.get("steps")),
                    "draft_vocab": meta.get("draft_vocab_size"), "acc_by_step": acc, "step_seconds": wall}
    return out


def eagle2_steps(heads: Path, arm: str, model: str, steps: int) -> list[float]:
    """Held-out agreement of an EAGLE-2 head at drafting steps 1..``steps`` on the validation
    sequences its training held out (the HCA forward: step j drafts from its own j-1 outputs).
    A head trained with one pass reports step 1 only; this measures all, like the others."""
    from dataclasses import replace

    import torch

    from selfspec.heads.eagle import load_head
    from selfspec.models.loading import load_model
    from selfspec.train.features import read_sequences
    from selfspec.train.hca import HcaModel
    from selfspec.train.loop import split
    from selfspec.train.trainer import TrainOptions, evaluate

    torch.set_num_threads(2)
    target = load_model(model)
    opts = TrainOptions(passes=steps)
    _, val = split(list(read_sequences(heads / "features")), opts.val_fraction)
    head, _ = load_head(heads / arm, target.model)
    m = evaluate(HcaModel(head, steps), target.model, val, replace(opts, objective="hass"), batch_size=4)
    return [m[f"acc{j}"] for j in range(1, steps + 1)]


def arm_of(method: str) -> tuple[str, str] | None:
    """(arm, tree) of a bench label such as ``hass:head=/x/eagle3-hass:total_tokens=24@onednn``."""
    for arm in ARMS:
        if f"/{arm}" in method:
            return arm, ("fixed 24" if "total_tokens=24" in method else "default")
    return None


def bench_rows(dirs: list[Path]) -> list[dict]:
    """``hass_ablation.bench_rows`` (one row per method and run) with the arm, the tree and the machine."""
    from hass_ablation import bench_rows as rows_of  # scripts/ is on sys.path when run as a script

    rows = rows_of(dirs)
    for r in rows:
        a = arm_of(r["method"])
        meta = json.loads((next(d for d in dirs if d.name == r["run"]) / "report.json").read_text())["meta"]
        base = r["method"].split("@")[0]
        if a is None and base in ("eagle2", "hass"):
            a = (f"shipped {base} head", "default")
        r |= {"arm": a[0] if a else base, "tree": a[1] if a else "",
              "backend": r["method"].split("@")[-1], "machine": meta["environment"]["machine"]}
    return rows


def plot(heads: dict, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted({r["run"] for r in rows})
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(5 * (len(runs) + 1), 4), squeeze=False)
    ax = axes[0][0]
    for arm, h in heads.items():
        if h["acc_by_step"]:
            ax.plot(range(1, len(h["acc_by_step"]) + 1), h["acc_by_step"], marker="o", label=arm)
    ax.set_title("held-out agreement (validation)")
    ax.set_xlabel("drafting step")
    ax.set_ylabel("top-1 agreement with the target")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    for ax, run in zip(axes[0][1:], runs):
        for r in rows:
            if r["run"] == run and r["tree"] == "fixed 24" and r["acceptance_by_depth"]:
                acc = r["acceptance_by_depth"]
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['arm']} (tau {r['tau']:.2f})")
        ax.set_title(f"{run}: fixed 24-node tree")
        ax.set_xlabel("draft depth")
        ax.set_ylabel("acceptance rate at depth")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=Path, required=True)
    p.add_argument("--bench", type=Path, nargs="*", default=[])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    heads = head_rows(a.heads)
    steps = max((len(h["acc_by_step"]) for h in heads.values()), default=1)
    for arm, h in heads.items():
        if arm.startswith("eagle2") and len(h["acc_by_step"]) < steps:
            h["acc_by_step"] = eagle2_steps(a.heads, arm, a.model, steps)
    rows = bench_rows(a.bench)
    (a.out / "comparison.json").write_text(json.dumps({"heads": heads, "bench": rows}, indent=1) + "\n")
    n = max((len(h["acc_by_step"]) for h in heads.values()), default=0)
    lines = ["# EAGLE-2 vs EAGLE-3 heads, EAGLE vs HASS objective, equal training budget", "",
             "## Training budget and held-out top-1 agreement at drafting step j (each head's validation)", "",
             "| head | sequences | tokens | epochs | optimiser steps | passes / TTT steps | draft vocab | "
             "s per step (median, 1 thread) | "
             + " | ".join(f"step {j}" for j in range(1, n + 1)) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * n]
    for arm, h in heads.items():
        acc = [f"{x:.3f}" for x in h["acc_by_step"]] + ["-"] * (n - len(h["acc_by_step"]))
        t = f"{h['step_seconds']:.2f}" if h["step_seconds"] else "-"
        lines.append(f"| {arm} | {h['sequences']} | {h['tokens']} | {h['epochs']} | {h['steps']} | {h['passes']} | "
                     f"{h['draft_vocab']} | {t} | " + " | ".join(acc) + " |")
    lines += ["", "## Benchmark (greedy, default kernels; speedup = tok/s over `ar` in the same run)", "",
              "| run | head | tree | tau | speedup vs ar | tok/s | drafting share of wall time | acceptance by depth | "
              "identical to ar |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " ".join(f"{x:.2f}" for x in r["acceptance_by_depth"])
        share = f"{r['draft_share']:.2f}" if r["draft_share"] is not None else "-"
        lines.append(f"| {r['run']} | {r['arm']} | {r['tree']} | {r['tau']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['tok_s']:.2f} | {share} | {acc} | {r['identical'] or ''} |")
    if rows:
        lines += ["", f"Machine: {rows[0]['machine']}, kernels {rows[0]['backend']}."]
    (a.out / "comparison.md").write_text("\n".join(lines) + "\n")
    if rows or heads:
        plot(heads, rows, a.out / "acceptance_by_depth.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
