"""Held-out acceptance against training tokens, and the tokens a method would need to pay (issue 32).

Reads training runs made with ``selfspec train`` (``OUT/train/history.json`` when finished, else the
latest checkpoint's ``trainer_state.json``: a run still going is read as far as it got). The loop
validates at log-spaced steps (8, 16, 32, ...) besides four even ones, so each run gives a curve of
held-out top-1 accuracy at draft depth j = 1..3 (``acc{j}``: the j-th draft token right, given a
right prefix, on the run's held-out 5% of the data) against training tokens seen.

Tokens seen at step s = s x (training tokens per epoch) / (steps per epoch), from the run's data
(``data/examples.pt`` is not read: the token count comes from the run's recorded data summary).

The tokens needed for a speedup x come from the cost model: x = tau / (draft cost + verify cost)
in units of T(1) (``experiments/backoff_diagnostics.py`` measures both per method with drafting forced);
tau = 1 + sum_k prod_{j<=k} acc_j over the method's draft depth. Each acc_j is fitted linearly in
log10(tokens) over the points past the first epoch's warm-up and extrapolated (clipped to [0, 1])
until tau reaches the needed value. Such learning curves bend over (accuracy saturates), so the
extrapolation is optimistic: the figure is a lower bound on the tokens needed.

    python scripts/acceptance_curve.py --run sdsat=$SELFSPEC_HOME/curves/smollm2-sdsat \
        --diagnostics docs/results/backoff-diagnostics-avx2/diagnostics.json --out docs/results/acceptance-curves-avx2

``--keep`` adds a run to an existing page: the other methods' rows are read back from its
``curves.json``, so a curve measured in an earlier session stays on the plot and in the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DEPTHS = (1, 2, 3)
MIN_STEP = 8  # points before this are the warm-up (learning rate ramp): not fitted


def read_state(out: Path) -> dict:
    """The training state of run ``out``: final history, else the latest checkpoint's."""
    final = out / "train" / "history.json"
    if final.is_file():
        return json.loads(final.read_text())
    cks = sorted((out / "train" / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not cks:
        raise SystemExit(f"{out}: no history.json and no checkpoint yet")
    return json.loads((cks[-1] / "trainer_state.json").read_text())


def tokens_per_step(out: Path, state: dict) -> float:
    """Training tokens per optimiser step: the run's data tokens (minus the held-out share) per
    epoch over its steps per epoch."""
    meta = None
    for name in ("adapter/selfspec_finetune.json", "selfspec_head.json", "data/summary.json"):
        p = out / name
        if p.is_file():
            meta = json.loads(p.read_text())
            break
    opts = state["options"]
    flat = {**opts, **opts.get("finetune", {})}
    if (meta is None or "tokens" not in meta) and (out / "data" / "examples.pt").is_file():
        meta = examples_summary(out / "data" / "examples.pt")  # a run still going: its prepared data
    if meta is None or "tokens" not in meta:
        raise SystemExit(f"{out}: no record of its data's token count (adapter/selfspec_finetune.json)")
    n_items = meta.get("examples") or meta.get("sequences")
    val = float(flat.get("val_fraction", 0.05))
    batch = int(flat.get("batch_size", 4))
    steps_per_epoch = max(1, int(n_items * (1 - val)) // batch)
    return meta["tokens"] * (1 - val) / steps_per_epoch


def examples_summary(path: Path) -> dict:
    """``{"examples", "tokens"}`` of a fine-tune's prepared data (``data/examples.pt``)."""
    import torch

    data = torch.load(path, weights_only=False)
    examples = data["examples"] if isinstance(data, dict) else data
    return {"examples": len(examples), "tokens": int(sum(e.input_ids.numel() for e in examples))}


def fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares a + b log10(t) over (tokens, acc) points; None with fewer than 2."""
    if len(points) < 2:
        return None
    xs = [math.log10(t) for t, _ in points]
    ys = [a for _, a in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def tau_at(fits: dict[int, tuple[float, float]], tokens: float, depth: int) -> float:
    """1 + sum_k prod_{j<=k} acc_j, acc_j from its fit (depths beyond the fitted ones repeat the last)."""
    tau, run = 1.0, 1.0
    last = max(fits)
    for j in range(1, depth + 1):
        a, b = fits[min(j, last)]
        run *= min(1.0, max(0.0, a + b * math.log10(tokens)))
        tau += run
    return tau


def tokens_needed(fits: dict[int, tuple[float, float]], tau_needed: float, depth: int, start: float) -> float | None:
    """Fewest tokens (from ``start``, x1.1 steps up to 1e13) at which the fitted tau reaches ``tau_needed``."""
    t = start
    while t < 1e13:
        if tau_at(fits, t, depth) >= tau_needed:
            return t
        t *= 1.1
    return None


def analyse(label: str, out: Path, diag: dict | None) -> dict:
    state = read_state(out)
    per_step = tokens_per_step(out, state)
    vals = [v for v in state["val"] if all(f"acc{j}" in v for j in DEPTHS)]
    points = [{"step": v["step"], "tokens": v["step"] * per_step, **{f"acc{j}": v[f"acc{j}"] for j in DEPTHS}}
              for v in vals]
    fits = {}
    for j in DEPTHS:
        f = fit([(p["tokens"], p[f"acc{j}"]) for p in points if p["step"] >= MIN_STEP])
        if f is not None:
            fits[j] = f
    row = {"run": str(out), "steps": state["step"], "tokens_per_step": per_step,
           "tokens_seen": state["step"] * per_step, "points": points,
           "fits": {f"acc{j}": {"intercept": a, "per_decade": b} for j, (a, b) in fits.items()}}
    if diag is not None and fits and len(fits) == len(DEPTHS):
        cost = diag["forced"]["draft_cost_T1"] + diag["forced"]["verify_cost_T1"]
        depth = len(diag["forced"]["acceptance_by_depth"])
        row["cost_T1"] = cost
        row["depth"] = depth
        start = max(row["tokens_seen"], 1.0)
        for x in (1.2, 1.5):
            need = tokens_needed(fits, x * cost, depth, start)
            row[f"tau_for_{x}x"] = x * cost
            row[f"tokens_for_{x}x"] = need
    return row


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.8), squeeze=False)
    for ax, (label, row) in zip(axes[0], rows.items()):
        pts = [p for p in row["points"] if p["tokens"] > 0]
        for j, color in zip(DEPTHS, ("C0", "C1", "C2")):
            ax.plot([p["tokens"] for p in pts], [p[f"acc{j}"] for p in pts], "o-", color=color, label=f"depth {j}")
            f = row["fits"].get(f"acc{j}")
            if f and pts:
                hi = max(row.get("tokens_for_1.5x") or 0, 10 * pts[-1]["tokens"])
                xs = [pts[0]["tokens"] * (hi / pts[0]["tokens"]) ** (i / 40) for i in range(41)]
                ax.plot(xs, [min(1, max(0, f["intercept"] + f["per_decade"] * math.log10(x))) for x in xs], ":",
                        color=color)
        for x in (1.2, 1.5):
            t = row.get(f"tokens_for_{x}x")
            if t:
                ax.axvline(t, color="grey", ls="--", lw=0.8)
                ax.text(t, 0.95, f" {x}x", color="grey", va="top")
        ax.set_xscale("log")
        ax.set_ylim(0, 1)
        ax.set_xlabel("training tokens seen")
        ax.set_ylabel("held-out top-1 accuracy")
        ax.set_title(label)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="METHOD=DIR of a `selfspec train` run (repeat)")
    ap.add_argument("--diagnostics", type=Path, help="backoff_diagnostics.py JSON: draft and verify cost per method")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--keep", action="store_true",
                    help="keep the other methods' rows of OUT/curves.json (earlier runs whose directories are gone)")
    args = ap.parse_args(argv)
    diag = json.loads(args.diagnostics.read_text())["methods"] if args.diagnostics else {}
    earlier = args.out / "curves.json"
    rows = json.loads(earlier.read_text())["methods"] if args.keep and earlier.is_file() else {}
    for spec in args.run:
        label, _, d = spec.partition("=")
        if not d:
            print(f"acceptance_curve: --run takes METHOD=DIR, not {spec!r}", file=sys.stderr)
            return 2
        rows[label] = analyse(label, Path(d).expanduser(), diag.get(label))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curves.json").write_text(json.dumps({"command": " ".join(sys.argv), "diagnostics":
                                                      str(args.diagnostics or ""), "methods": rows}, indent=1) + "\n")
    lines = ["| method | steps | tokens seen | acc1 / acc2 / acc3 (last) | per decade of tokens | cost (T(1)) "
             "| tokens for 1.2x | tokens for 1.5x |", "|---|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        last = r["points"][-1] if r["points"] else {}
        accs = " / ".join(f"{last.get(f'acc{j}', float('nan')):.3f}" for j in DEPTHS)
        slopes = " / ".join(f"{r['fits'][f'acc{j}']['per_decade']:+.3f}" if f"acc{j}" in r["fits"] else "-"
                            for j in DEPTHS)

        def fmt(t):
            return "beyond 1e13" if t is None else f"{t:.2g}"

        lines.append(f"| {label} | {r['steps']} | {r['tokens_seen']:.3g} | {accs} | {slopes} | "
                     f"{r.get('cost_T1', float('nan')):.2f} | {fmt(r.get('tokens_for_1.2x'))} | "
                     f"{fmt(r.get('tokens_for_1.5x'))} |")
    (args.out / "curves.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        plot(rows, args.out / "curves.png")
    except ImportError:
        print("acceptance_curve: matplotlib missing: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
