"""Figures of the self-drafting fine-tuned methods (``sdsat``, ``space``) from benchmark records:
acceptance by draft position for each k (SDSAT's Fig. 3 analogue), and tokens per loop / per
forward / speedup against k. Writes ``summary.md``, ``summary.json`` and ``acceptance.png`` into
``--out``.

    python experiments/selfdraft_figures.py --method sdsat --bench docs/results/smollm2-sdsat-humaneval \
        docs/results/smollm2-sdsat-mt-bench --out docs/results/sdsat

A *loop* is one drafting cycle: for ``sdsat`` a draft step (depth 0, one token) plus the verify
step after it; for ``space`` a single step (it drafts and verifies in the same forward).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from selfspec.bench.records import read_records


def loops(rec: dict) -> list[tuple[int, int]]:
    """(drafted k, accepted a) of every verify step of one record (draft steps have depth 0)."""
    out = []
    for c, d in zip(rec["committed_per_step"][1:], rec["drafted_per_step"][1:]):
        if d > 0:
            out.append((d, c - 1))
    return out


def summarize(records: list[dict], method: str = "sdsat", sampling: bool = False) -> dict[str, dict]:
    """Per method entry: tokens per forward / loop, acceptance by position, median speedup and
    greedy identity with ``ar`` (``"(sampling)"`` when the run sampled: outputs differ by design)."""
    by: dict[str, list[dict]] = {}
    for r in records:
        if r.get("kind") == "method":
            by.setdefault(r["method"], []).append(r)
    out = {}
    for name, recs in by.items():
        backend = name.partition("@")[2]  # compare against ar on the same kernels backend
        ar = {r["prompt_id"]: r for r in by.get("ar" + (f"@{backend}" if backend else ""), [])}
        steps = [lp for r in recs for lp in loops(r)]
        kmax = max((k for k, _ in steps), default=0)
        reach = [sum(1 for k, a in steps if k >= j) for j in range(1, kmax + 1)]
        acc = [sum(1 for k, a in steps if k >= j and a >= j) / n if n else 0.0
               for j, n in zip(range(1, kmax + 1), reach)]
        new = sum(r["new_tokens"] for r in recs)
        forwards = sum(r["steps"] - 1 for r in recs)  # prefill excluded
        ratios = [(r["new_tokens"] / r["wall_s"]) / (ar[r["prompt_id"]]["new_tokens"] / ar[r["prompt_id"]]["wall_s"])
                  for r in recs if r["prompt_id"] in ar]
        identical = sum(r["token_ids"] == ar[r["prompt_id"]]["token_ids"] for r in recs if r["prompt_id"] in ar)
        out[name] = {
            "prompts": len(recs),
            "tokens_per_forward": (new - len(recs)) / max(1, forwards),
            # sdsat: the draft step's token + accepted + bonus; space: accepted + bonus
            "tokens_per_loop": (sum(a + (2 if method == "sdsat" else 1) for _, a in steps) / len(steps))
            if steps else None,
            "accept_rate": (sum(a for _, a in steps) / sum(k for k, _ in steps)) if steps else None,
            "acceptance_by_position": acc,
            "loops": len(steps),
            # share of forwards spent in drafting loops (an sdsat loop is two forwards, a space loop one)
            "drafting_share": len(steps) * (2 if method == "sdsat" else 1) / max(1, forwards),
            "median_speedup": statistics.median(ratios) if ratios else None,
            "identical_to_ar": "(sampling)" if sampling else f"{identical}/{len(recs)}",
        }
    return out


def f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", nargs="+", required=True, help="benchmark output directories")
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", default="sdsat", choices=["sdsat", "space"], help="what the runs benchmark")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result, lines = {}, []
    for d in map(Path, args.bench):
        recs = read_records(d)
        meta = json.loads((d / "meta.json").read_text())
        s = summarize(recs, args.method, meta["generation"]["temperature"] > 0)
        result[d.name] = {"dataset": meta["dataset"], "temperature": meta["generation"]["temperature"], "methods": s}
        gen = meta["generation"]
        lines += [f"### {d.name} ({meta['dataset']}, {meta['prompts']} prompts, T = {gen['temperature']},"
                  f" {gen['max_new_tokens']} tokens)", "",
                  "| method | tokens / forward | tokens / loop | accept rate | acceptance at position 1..k | "
                  "loops | median speedup vs ar | identical to ar |", "|---|---|---|---|---|---|---|---|"]
        for name, m in s.items():
            accs = " ".join(f"{a:.2f}" for a in m["acceptance_by_position"]) or "-"
            lines.append(f"| {name} | {f(m['tokens_per_forward'])} | {f(m['tokens_per_loop'])} | {f(m['accept_rate'])} "
                         f"| {accs} | {m['loops']} | {f(m['median_speedup'])}x | {m['identical_to_ar']} |")
        lines.append("")
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run, r in result.items():
        for name, m in r["methods"].items():
            if m["acceptance_by_position"] and ":k=" in name:
                accs = m["acceptance_by_position"]
                label = f"{run.removeprefix(f'smollm2-{args.method}-')} T={r['temperature']:g} {name}"
                axes[0].plot(range(1, len(accs) + 1), accs, marker="o", label=label)
        ks = sorted((int(re.split(r"[^0-9]", n.split("k=")[1])[0]), m) for n, m in r["methods"].items()
                    if n.startswith(f"{args.method}:k=") and r["temperature"] == 0)
        if len(ks) > 1:
            axes[1].plot([k for k, _ in ks], [m["tokens_per_loop"] for _, m in ks], marker="o",
                         label=f"{run}: tokens / loop")
            axes[1].plot([k for k, _ in ks], [m["tokens_per_forward"] for _, m in ks], marker="s",
                         label=f"{run}: tokens / forward")
            axes[1].plot([k for k, _ in ks], [m["median_speedup"] for _, m in ks], marker="^",
                         label=f"{run}: speedup vs ar")
    token = "adaptive token" if args.method == "sdsat" else "mask"
    axes[0].set_xlabel(f"draft position j ({token} j)")
    axes[0].set_ylabel("P(first j drafts accepted)")
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel(f"k ({token}s per loop)")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{args.method.upper()} on SmolLM2-135M-Instruct: acceptance by position and the k sweep")
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)


if __name__ == "__main__":
    main()
