"""MSN figures: MSN's central claim on this machine. Reads one benchmark run per model (base, plain
SFT, MSN; each with ``jacobi`` and ``msn`` entries), both fine-tunes' training histories and quality
reports, and writes ``summary.md``, ``summary.json`` and two plots into ``--out``:

* ``mat.png``: mean accepted tokens per forward (the paper's MAT, prefill excluded) and median
  speedup over ``ar`` of the same model, per decoder, for the three models side by side;
* ``training.png``: validation loss of MSN and SFT, and MSN's top-1 accuracy at noised inputs.

    python experiments/msn_figures.py --bench docs/results/smollm2-jacobi-mt-bench \
        docs/results/smollm2-sft-jacobi-mt-bench docs/results/smollm2-msn-jacobi-mt-bench ... \
        --training ~/.cache/selfspec/finetune/smollm2-135m-instruct-{msn,sft} \
        --quality docs/results/msn-quality.json docs/results/sft-quality.json --out docs/results/msn
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from selfspec.bench.records import read_records


def summarize(records: list[dict]) -> dict[str, dict]:
    """Per method entry: tokens per forward (prefill excluded), acceptance by depth (accepted /
    verified at that depth: P(first j drafts accepted | j drafted)), median per-prompt speedup over
    ``ar`` on the same backend, greedy identity with ``ar``."""
    by: dict[str, list[dict]] = {}
    for r in records:
        if r.get("kind") == "method":
            by.setdefault(r["method"], []).append(r)
    out = {}
    for name, recs in by.items():
        backend = name.partition("@")[2]
        ar = {r["prompt_id"]: r for r in by.get("ar" + (f"@{backend}" if backend else ""), [])}
        steps = [(d, c - 1) for r in recs for c, d in zip(r["committed_per_step"][1:], r["drafted_per_step"][1:])]
        drafted = [(d, a) for d, a in steps if d > 0]
        depth = max((d for d, _ in drafted), default=0)
        acc = []
        for j in range(1, depth + 1):
            reach = [a for d, a in drafted if d >= j]
            acc.append(sum(a >= j for a in reach) / len(reach) if reach else 0.0)
        new = sum(r["new_tokens"] for r in recs)
        forwards = sum(r["steps"] - 1 for r in recs)
        ratios = [(r["new_tokens"] / r["wall_s"]) / (ar[r["prompt_id"]]["new_tokens"] / ar[r["prompt_id"]]["wall_s"])
                  for r in recs if r["prompt_id"] in ar]
        tps = new / sum(r["wall_s"] for r in recs)
        ar_tps = sum(r["new_tokens"] for r in ar.values()) / max(1e-9, sum(r["wall_s"] for r in ar.values()))
        out[name] = {
            "prompts": len(recs),
            "tokens_per_forward": (new - len(recs)) / max(1, forwards),
            "acceptance_by_depth": acc,
            "drafting_share": len(drafted) / max(1, len(steps)),
            "tokens_per_s": tps,
            "speedup": tps / ar_tps if ar else None,
            "median_speedup": statistics.median(ratios) if ratios else None,
            "identical_to_ar": sum(r["token_ids"] == ar[r["prompt_id"]]["token_ids"]
                                   for r in recs if r["prompt_id"] in ar),
        }
    return out


def label(model: str) -> str:
    """``smollm2-135m-instruct-msn`` -> ``msn``; the base model -> ``base``."""
    tail = model.rsplit("-", 1)[-1]
    return tail if tail in ("msn", "sft") else "base"


def f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", nargs="+", required=True, help="benchmark output directories (any models, datasets)")
    ap.add_argument("--training", nargs="*", default=[], help="fine-tune output directories (train/history.json)")
    ap.add_argument("--quality", nargs="*", default=[], help="scripts/finetune_quality.py outputs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, dict]] = {}  # dataset -> model label -> {meta, methods}
    for d in map(Path, args.bench):
        recs = read_records(d)
        meta = json.loads((d / "meta.json").read_text())
        runs.setdefault(meta["dataset"], {})[label(meta["model"])] = {"meta": meta, "methods": summarize(recs)}
    lines = []
    for ds, models in runs.items():
        meta = next(iter(models.values()))["meta"]
        gen = meta["generation"]
        lines += [f"### {ds}: {meta['prompts']} prompts, T = {gen['temperature']}, {gen['max_new_tokens']} tokens, "
                  f"kernels {', '.join(meta['kernels'])}", "",
                  "| model | method | tokens / forward (MAT) | acceptance at depth 1..5 | drafting steps | tok/s "
                  "| speedup vs ar | median speedup | identical to ar |", "|---|---|---|---|---|---|---|---|---|"]
        for model in ("base", "sft", "msn"):
            for name, m in models.get(model, {}).get("methods", {}).items():
                accs = " ".join(f"{a:.2f}" for a in m["acceptance_by_depth"][:5]) or "-"
                lines.append(f"| {model} | {name} | {f(m['tokens_per_forward'])} | {accs} | {f(m['drafting_share'])} "
                             f"| {f(m['tokens_per_s'])} | {f(m['speedup'])}x | {f(m['median_speedup'])}x "
                             f"| {m['identical_to_ar']}/{m['prompts']} |")
        lines.append("")
    training = {}
    for d in map(Path, args.training):
        hist = json.loads((d / "train" / "history.json").read_text())
        name = label(d.name)
        steps = [h["seconds"] for h in hist["history"]]
        # the median: a step's time includes any pause of the process (a stopped or suspended job)
        training[name] = {"validation": hist["val"], "steps": hist["step"],
                          "median_seconds_per_step": statistics.median(steps) if steps else None}
    if training:
        lines += ["### training (validation, first and last)", "",
                  "| run | steps | s/step | plain loss | noisy loss | top-1 at noised inputs |",
                  "|---|---|---|---|---|---|"]
        for name, t in training.items():
            v0, v1 = t["validation"][0], t["validation"][-1]
            lines.append(f"| {name} | {t['steps']} | {f(t['median_seconds_per_step'], 1)} | "
                         f"{f(v0.get('plain'), 3)} → {f(v1.get('plain'), 3)} | "
                         f"{f(v0.get('noisy'), 3)} → {f(v1.get('noisy'), 3)} | "
                         f"{f(v0.get('acc_noisy'), 3)} → {f(v1.get('acc_noisy'), 3)} |")
        lines.append("")
    quality = {}
    for q in map(Path, args.quality):
        r = json.loads(q.read_text())
        quality[label(r["model"])] = r
    if quality:
        lines += ["### quality against the base", "",
                  "| model | ppl code base → tuned | ppl chat base → tuned | top-1 agreement code / chat "
                  "| greedy answers identical | mean common prefix |", "|---|---|---|---|---|---|"]
        for name, r in quality.items():
            p = list(r["perplexity"].values())
            g = r["greedy"]
            lines.append(f"| {name} | {f(p[0]['base']['perplexity'], 3)} → {f(p[0]['tuned']['perplexity'], 3)} | "
                         f"{f(p[1]['base']['perplexity'], 3)} → {f(p[1]['tuned']['perplexity'], 3)} | "
                         f"{f(p[0]['tuned']['top1_agree'], 3)} / {f(p[1]['tuned']['top1_agree'], 3)} | "
                         f"{g['identical']}/{g['prompts']} | {f(g['mean_common_prefix'], 1)} |")
        lines.append("")
    result = {"runs": {ds: {m: v["methods"] for m, v in ms.items()} for ds, ms in runs.items()},
              "training": training,
              "quality": quality}
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.6 * len(runs)), squeeze=False)
    for row, (ds, models) in enumerate(runs.items()):
        names = [n for n in next(iter(models.values()))["methods"] if not n.startswith("ar")]
        width = 0.8 / max(1, len(models))
        for i, model in enumerate(m for m in ("base", "sft", "msn") if m in models):
            ms = models[model]["methods"]
            xs = [j + i * width for j in range(len(names))]
            axes[row][0].bar(xs, [ms[n]["tokens_per_forward"] if n in ms else 0 for n in names], width, label=model)
            axes[row][1].bar(xs, [ms[n]["speedup"] or 0 if n in ms else 0 for n in names], width, label=model)
        for ax, what in zip(axes[row], ("tokens per forward (MAT)", "speedup vs ar (same model)")):
            ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(names))])
            ax.set_xticklabels([n.partition("@")[0] for n in names], fontsize=7, rotation=10)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_title(f"{ds}: {what}", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle("Jacobi / TR-Jacobi on SmolLM2-135M-Instruct: base vs plain SFT vs MSN (equal budget)")
    fig.tight_layout()
    fig.savefig(out / "mat.png", dpi=110)
    if training:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        for name, t in training.items():
            v = t["validation"]
            axes[0].plot([x["step"] for x in v], [x.get("plain") for x in v], marker="o", label=f"{name}: plain loss")
            if any("acc_noisy" in x for x in v):
                pts = [(x["step"], x["acc_noisy"]) for x in v if "acc_noisy" in x]
                axes[1].plot(*zip(*pts), marker="o", label=f"{name}: top-1 at noised inputs")
        axes[0].set_xlabel("step")
        axes[0].legend(fontsize=8)
        axes[1].set_xlabel("step")
        axes[1].legend(fontsize=8)
        fig.suptitle("MSN vs plain SFT: validation")
        fig.tight_layout()
        fig.savefig(out / "training.png", dpi=110)


if __name__ == "__main__":
    main()
