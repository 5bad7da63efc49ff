"""Measured limits of self-spec on this machine, from a proxy search's trials.

Reads the optuna journal of ``selfspec tune MODEL --method self-spec --objective proxy`` and
writes, into --out:
- ``agreement_vs_skip.png``: top-1 agreement of the skipped model with the full model against
  the fraction of sub-layers skipped, coloured by predicted speedup;
- ``search.png``: predicted speedup per trial and best so far;
- ``limits.json``: per skip-ratio bin the best agreement, draft cost share and predicted
  speedup, plus what the same cost model predicts for other (larger-model / GPU) regimes.

Usage: python experiments/self_spec_limits.py STATE_DIR CONFIG_JSON --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def trials(state: Path) -> list[dict]:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(str(state / "journal.log")))
    study = optuna.load_study(study_name="self-spec", storage=storage)
    out = []
    for t in study.trials:
        if t.value is None:
            continue
        n = sum(1 for k in t.params if k.startswith("attn"))
        skipped = sum(t.params.values())
        out.append({"number": t.number, "score": t.value, "skip_ratio": skipped / (2 * n),
                    "skip_attention": sum(v for k, v in t.params.items() if k.startswith("attn")),
                    "skip_mlp": sum(v for k, v in t.params.items() if k.startswith("mlp")), **t.user_attrs})
    return out


def predicted_speedup(alpha: float, c: float, v: float, k_max: int = 12) -> tuple[float, int]:
    """Best chain length and speedup ``E[tokens] / (k c + v(k+1))`` with i.i.d. acceptance alpha,
    a draft costing c of a full forward and a verify of k+1 tokens costing ``1 + v * k`` of one."""
    best = (1.0, 0)
    for k in range(1, k_max + 1):
        e = (1 - alpha ** (k + 1)) / (1 - alpha)
        s = e / (k * c + 1 + v * k)
        best = max(best, (s, k))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("state", type=Path)
    ap.add_argument("config", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = trials(args.state)
    cfg = json.loads(args.config.read_text())
    bins = {}
    for r in rows:
        b = round(r["skip_ratio"] * 10) / 10
        cur = bins.get(b)
        if cur is None or r["top1_agreement"] > cur["top1_agreement"]:
            bins[b] = {k: r[k] for k in ("skip_ratio", "top1_agreement", "draft_cost_ratio", "score", "tau")}
    prof = cfg["search"]
    scenarios = []
    # (what, alpha, c = draft cost share, v = marginal verify cost per extra token)
    for what, alpha, c, v in [
        ("this machine, tuned set (measured alpha and c; verify slope 0.04/token as Qwen-1.5B onednn)",
         prof.get("acceptance", 0.0), prof.get("draft_cost_ratio", 1.0), 0.04),
        ("paper 13B on A100 (skip 0.43, c~0.6, flat verify)", 0.90, 0.60, 0.0),
        ("paper-scale best case (alpha 0.95, c 0.5, near-flat verify)", 0.95, 0.50, 0.02),
        ("larger model on CPU (skip 0.4, alpha 0.85, c 0.6, v 0.05)", 0.85, 0.60, 0.05),
        ("small model, ideal flat verify (alpha 0.8, c 0.75)", 0.80, 0.75, 0.0),
    ]:
        s, k = predicted_speedup(alpha, c, v)
        scenarios.append({"scenario": what, "alpha": alpha, "draft_cost": c, "verify_slope": v,
                          "best_k": k, "predicted_speedup": round(s, 3)})
    summary = {"model": cfg["model"], "trials": len(rows), "best": {k: prof.get(k) for k in
               ("score", "top1_agreement", "acceptance", "tau", "draft_cost_ratio", "skip_ratio")},
               "by_skip_ratio": [bins[b] for b in sorted(bins)], "draft_cost_table": prof.get("draft_cost"),
               "cost_model_scenarios": scenarios}
    (args.out / "limits.json").write_text(json.dumps(summary, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sc = ax.scatter([r["skip_ratio"] for r in rows], [r["top1_agreement"] for r in rows],
                    c=[r["score"] for r in rows], cmap="viridis", s=14)
    fig.colorbar(sc, label="predicted speedup over ar")
    ax.set_xlabel("fraction of sub-layers skipped")
    ax.set_ylabel("top-1 agreement with the full model")
    ax.set_title(f"{cfg['model']}: {len(rows)} proxy trials")
    fig.tight_layout()
    fig.savefig(args.out / "agreement_vs_skip.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    scores = [r["score"] for r in sorted(rows, key=lambda r: r["number"])]
    best, run = [], float("-inf")
    for s, r in zip(scores, sorted(rows, key=lambda r: r["number"])):
        if r["skip_ratio"] > 0:
            run = max(run, s)
        best.append(run)
    ax.plot(scores, ".", ms=4, label="trial")
    ax.plot(best, "-", label="best non-empty so far")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("trial")
    ax.set_ylabel("predicted speedup over ar")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "search.png", dpi=110)
    plt.close(fig)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
