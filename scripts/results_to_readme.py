"""Regenerate the README "Results" section from `selfspec bench` output directories.

usage: python scripts/results_to_readme.py README.md BENCH_DIR [BENCH_DIR ...]
"""

import json
import sys
from pathlib import Path

START, END = "<!-- results:start -->", "<!-- results:end -->"


def section(bench_dir: Path) -> str:
    rep = json.loads((bench_dir / "report.json").read_text())
    meta, summ = rep["meta"], rep["summary"]
    env, g = meta["environment"], meta["generation"]
    draft = f", draft `{meta['draft_model']}`" if meta.get("draft_model") else ""
    lines = [
        f"**{meta['model']}**{draft}: dataset `{meta['dataset']}` ({meta['prompts']} prompts), "
        f"{'greedy' if not g.get('temperature') else 'temperature ' + str(g['temperature'])}, "
        f"max_new_tokens {g['max_new_tokens']}; machine `{env['machine']}`, torch {env['torch']}, "
        f"transformers {env['transformers']}, git {env['git']}.",
        "",
        "| method | kernels | kind | tok/s | speedup vs ar | vs hf | tau | identical to ar | HumanEval pass@1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summ.items():
        tau = f"{s['tau']:.2f}" if s.get("tau") else "-"
        p1 = f"{s['pass@1']:.2f}" if "pass@1" in s else "-"
        hf = f"{s['speedup_vs_hf']:.2f}x" if s.get("speedup_vs_hf") else "-"
        kernels = s.get("backend", "stock")
        kernels = "int8 (quantised)" if kernels == "int8" else kernels
        label = name if s.get("lossless", True) else f"{name} (**NOT lossless**)"
        lines.append(f"| {label} | {kernels} | {s['kind']} | {s['tokens_per_s']:.2f} | {s['speedup']:.2f}x | {hf} "
                     f"| {tau} | {s.get('identical', '-')} | {p1} |")
    return "\n".join(lines)


def main() -> None:
    readme = Path(sys.argv[1])
    body = "\n\n".join(section(Path(d)) for d in sys.argv[2:])
    text = readme.read_text()
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    note = ("Generated from `selfspec bench` reports by `scripts/results_to_readme.py` (runs: "
            "`scripts/bench_baselines.sh`, `scripts/bench_datasets.sh`, `scripts/bench_kernels.sh`, "
            "`scripts/bench_self_spec.sh`; one process per model, every method and peer on the same prompts in "
            "the same run after warm-up; speedup = ratio of tokens/s to `ar` on the same kernels, `vs hf` = ratio "
            "to `transformers` `generate` in fp32 in that run; `int8` is a quantised model, lossless with respect "
            "to itself, quality cost in `docs/performance.md`; runs were made on different days of a shared VM "
            "whose speed varies by up to 4x, so compare ratios within a run, not tok/s across runs).")
    readme.write_text(f"{head}{START}\n{note}\n\n{body}\n{END}{tail}")


if __name__ == "__main__":
    main()
