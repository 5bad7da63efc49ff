"""Summaries of bench records: tokens/s, speedup against ``ar``, tau, and greedy equality."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(records: list[dict], names: list[str]) -> dict:
    """Per method: tokens, wall, tok/s, speedup vs ar (ratio of tok/s over the same prompts),
    tau, per-category speedup and, in greedy runs, how many outputs equal ar's."""
    by = defaultdict(list)
    for r in records:
        by[r["method"]].append(r)
    ar_ids = {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in by.get("ar", [])}
    greedy = all(r.get("temperature", 0) == 0 for r in records)

    def tps(rs: list[dict]) -> float:
        wall = sum(r["wall_s"] for r in rs)
        return sum(r["new_tokens"] for r in rs) / wall if wall else 0.0

    ar_tps = tps(by.get("ar", []))
    ar_cat = defaultdict(list)
    for r in by.get("ar", []):
        ar_cat[r["category"]].append(r)
    out = {}
    for name in names:
        rs = by.get(name, [])
        if not rs:
            continue
        s: dict = {"runs": len(rs), "tokens": sum(r["new_tokens"] for r in rs),
                   "wall_s": sum(r["wall_s"] for r in rs), "tokens_per_s": tps(rs),
                   "kind": rs[0].get("kind", "method"), "lossless": all(r.get("lossless", True) for r in rs)}
        s["speedup"] = s["tokens_per_s"] / ar_tps if ar_tps else None
        s["median_tokens_per_s"] = statistics.median(r["new_tokens"] / r["wall_s"] for r in rs if r["wall_s"])
        steps = sum(r.get("steps", 0) for r in rs)
        s["tau"] = s["tokens"] / steps if steps else None
        cats = defaultdict(list)
        for r in rs:
            cats[r["category"]].append(r)
        s["by_category"] = {c: (tps(v) / tps(ar_cat[c]) if ar_cat.get(c) and tps(ar_cat[c]) else None)
                            for c, v in sorted(cats.items())}
        if greedy and ar_ids:
            same, diffs = 0, []
            for r in rs:
                ref = ar_ids.get((r["prompt_id"], r["repeat"]))
                if ref is None:
                    continue
                d = _first_diff(ref, r["token_ids"])
                if d is None:
                    same += 1
                else:
                    diffs.append({"prompt_id": r["prompt_id"], "repeat": r["repeat"], "position": d})
            s["identical"] = f"{same}/{same + len(diffs)}"
            s["differences"] = diffs
        out[name] = s
    return out


def write_report(out: Path, meta: dict, summary: dict) -> None:
    (out / "report.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    env = meta["environment"]
    g = meta["generation"]
    lines = [
        f"# selfspec bench: {meta['model']}",
        "",
        f"Dataset `{meta['dataset']}` ({meta['prompts']} prompts), max_new_tokens {g['max_new_tokens']}, "
        f"temperature {g['temperature']}, repeats {meta['repeats']}. Machine: {env['machine']}; "
        f"torch {env['torch']}, transformers {env['transformers']}, git {env['git']}.",
        "",
        "| method | kind | lossless | tokens | tok/s | speedup vs ar | tau | identical to ar | pass@1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        sp = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
        lossless = "yes" if s["lossless"] else "**NO**"
        p1 = f"{s['pass@1']:.3f}" if "pass@1" in s else "-"
        lines.append(f"| {name} | {s['kind']} | {lossless} | {s['tokens']} | {s['tokens_per_s']:.2f} | {sp} | {tau} "
                     f"| {s.get('identical', '-')} | {p1} |")
    cats = sorted({c for s in summary.values() for c in s["by_category"]})
    if len(cats) > 1:
        lines += ["", "Speedup by category:", "", "| method | " + " | ".join(cats) + " |",
                  "|---|" + "---|" * len(cats)]
        for name, s in summary.items():
            cells = [f"{s['by_category'].get(c):.2f}" if s["by_category"].get(c) else "-" for c in cats]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    diffs = {n: s["differences"] for n, s in summary.items() if s.get("differences")}
    if diffs:
        lines += ["", "Greedy outputs that differ from ar (first differing position):", ""]
        for n, d in diffs.items():
            lines.append(f"- {n}: " + ", ".join(
                f"{x['prompt_id']} at token {x['position']}"
                + (f" (ar's top-2 logit gap there: {x['ar_top2_gap']:.2e})" if "ar_top2_gap" in x else "")
                for x in d))
    if any("pass@1" in s for s in summary.values()):
        ar_p = summary.get("ar", {}).get("pass@1")
        same = all(s.get("pass@1") == ar_p for s in summary.values() if "pass@1" in s)
        lines += ["", f"HumanEval pass@1 equal to ar's for every method: {'yes' if same else 'NO'}"]
    plots = ["speedup_by_category.png", "speedup_tau.png", "accepted_length_hist.png", "cost_profile.png"]
    lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in plots)]
    (out / "report.md").write_text("\n".join(lines) + "\n")
