"""Regenerate the README's results summary, the per-run tables and the summary plot from
`selfspec bench` output directories.

usage: python scripts/results_to_readme.py [README.md] [BENCH_DIR ...]

- README.md, between the results markers: the defaults runs only (what a user gets with no flags):
  the default model's headline table per CPU family, the other models' lines, and the quantised
  (`--kernels int8`) runs under a heading of their own.
- docs/results/README.md: one row per method at its best measured greedy configuration (highest
  speedup over `ar` in any run; it left the README, whose figures are the defaults), then every
  run's full table.
- docs/results/summary.png: the summary as a bar chart.

Without BENCH_DIRs every directory under docs/results with a report.json is used.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from selfspec.bench.records import read_records
from selfspec.core.machine import CPU_FAMILIES, cpu_family
from selfspec.models.bundled import DEFAULT_MODEL

START, END = "<!-- results:start -->", "<!-- results:end -->"
RESULTS = Path("docs/results")
NOTE = ("one process per model, every method and peer on the same prompts in the same run after warm-up; "
        "speedup = ratio of tokens/s to `ar` on the same kernels, `vs hf` = ratio to `transformers` `generate` "
        "(fp32, stock kernels) in that run; `int8` is a quantised model, lossless with respect to itself, quality "
        "cost in `docs/performance.md`; runs were made on different days of a shared VM whose speed varies by up "
        "to 4x, so compare ratios within a run, not tok/s across runs")


def load(bench_dir: Path) -> dict:
    rep = json.loads((bench_dir / "report.json").read_text())
    rep["dir"] = bench_dir
    return rep


def kernels_of(s: dict) -> str:
    k = s.get("backend", "stock")
    return "int8 (quantised)" if k == "int8" else k


def section(rep: dict) -> str:
    meta, summ = rep["meta"], rep["summary"]
    env, g = meta["environment"], meta["generation"]
    draft = f", draft `{meta['draft_model']}`" if meta.get("draft_model") else ""
    lines = [
        f"**{meta['model']}**{draft} (`{rep['dir'].name}`): dataset `{meta['dataset']}` ({meta['prompts']} prompts), "
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
        label = name if s.get("lossless", True) else f"{name} (**NOT lossless**)"
        spd = f"{s['speedup']:.2f}x" if s.get("speedup") else "-"
        lines.append(f"| {label} | {kernels_of(s)} | {s['kind']} | {s['tokens_per_s']:.2f} | {spd} "
                     f"| {hf} | {tau} | {s.get('identical', '-')} | {p1} |")
    return "\n".join(lines)


def base_method(name: str) -> str:
    """``pld:k=4@onednn`` -> ``pld``; ``auto→msn@onednn`` -> ``auto``."""
    return name.split("@")[0].split(":")[0].split("→")[0]


def best_rows(reports: list[dict]) -> list[dict]:
    """Per method, the greedy entry with the highest speedup over ar in any run (ar: the run
    whose ar is fastest against transformers generate)."""
    best: dict[str, dict] = {}
    for rep in reports:
        meta = rep["meta"]
        if meta["generation"].get("temperature"):
            continue
        for name, s in rep["summary"].items():
            if s.get("kind") != "method" and name not in ("hf-pld", "hf-assisted"):
                continue
            m = base_method(name) + (" (int8 model)" if s.get("backend") == "int8" else "")
            key = (s.get("speedup_vs_hf") or 0.0) if base_method(name) == "ar" else (s.get("speedup") or 0.0)
            row = {"method": m, "entry": name, "s": s, "meta": meta, "key": key, "dir": rep["dir"].name}
            if m not in best or key > best[m]["key"]:
                best[m] = row
    order = ["auto", "ar", "pld", "draft-model", "self-spec", "eagle2", "hass", "sdsat", "space", "jacobi", "msn",
             "hf-pld", "hf-assisted"]

    def rank(r: dict) -> tuple:
        m = r["method"].split(" ")[0]
        return ("int8" in r["method"], order.index(m) if m in order else len(order))

    return sorted(best.values(), key=rank)


def summary_table(rows: list[dict]) -> str:
    lines = ["| method | best measured configuration | kernels | model, data | tau | speedup vs ar | vs transformers "
             "| identical to ar | hardware |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, meta = r["s"], r["meta"]
        tau = f"{s['tau']:.2f}" if s.get("tau") else "-"
        hf = f"{s['speedup_vs_hf']:.2f}x" if s.get("speedup_vs_hf") else "-"
        spd = f"{s['speedup']:.2f}x" if s.get("speedup") else "-"
        lossy = "" if s.get("lossless", True) else " (**NOT lossless**)"
        env = meta["environment"]
        cpu, threads = env["machine"].split("|")[:2]
        flags = f" ({env['cpu_flags']})" if env.get("cpu_flags") else " (flags not recorded)"
        lines.append(f"| {r['method']}{lossy} | `{r['entry']}` | {kernels_of(s)} | {meta['model']}, "
                     f"{meta['dataset']} ({meta['prompts']}) × {meta['generation']['max_new_tokens']} tok | {tau} | "
                     f"{spd} | {hf} | {s.get('identical', '-')} | {cpu}{flags}, {threads} |")
    return "\n".join(lines)


def other_model_defaults(rep: dict) -> bool:
    """A `defaults-*` run of a model other than the default one (its own line under the headline)."""
    name = rep["dir"].name
    return name.startswith("defaults-") and not name.startswith("defaults-smollm2")


def quantised(rep: dict) -> bool:
    """A run whose methods ran on the int8 model (``--kernels int8``): not what a user gets with no flags."""
    return any(s.get("backend") == "int8" for s in rep["summary"].values() if s.get("kind") == "method")


def spread(s: dict) -> str:
    """``; by category 1.07x-7.61x `ar``` (the method's lowest and highest category speedup): a mean
    that repetition in some categories lifts shows it."""
    cats = s.get("by_category") or {}
    if len(cats) < 2:
        return ""
    (lo_c, lo), (hi_c, hi) = min(cats.items(), key=lambda kv: kv[1]), max(cats.items(), key=lambda kv: kv[1])
    return f"; by category {lo:.2f}x `ar` ({lo_c}) to {hi:.2f}x ({hi_c})"


def llama_ratios(rep: dict, s: dict) -> str:
    """``, 0.92x llama.cpp F32 (exact comparison), 0.47x llama.cpp on its own Q4_K_M GGUF (lossy: 10/20
    identical)`` for a method's summary ``s``, where the run has those peers; else nothing."""
    out = []
    labels = {"llama.cpp-f32": "llama.cpp F32 (same weights)",
              "llama.cpp": "llama.cpp on {desc} (**lossy**: {ident} identical to `ar`)"}
    for peer, label in labels.items():
        p = rep["summary"].get(peer)
        if not p or not p.get("tokens_per_s"):
            continue
        desc = rep["meta"].get("peer_info", {}).get(peer, {}).get("desc", "its own GGUF")
        ratio = s["tokens_per_s"] / p["tokens_per_s"]
        out.append(f"{ratio:.2f}x " + label.format(desc=desc, ident=p.get("identical", "-")))
    return "; " + ", ".join(out) if out else ""


def defaults_line(reports: list[dict], int8: bool = False) -> str:
    """What a user gets with no flags, from the `scripts/bench_defaults.sh` runs (if present);
    ``int8``: the quantised runs of the other models instead, under their own heading."""
    out = []
    for rep in reports:
        if not other_model_defaults(rep) or quantised(rep) != int8:
            continue  # the default model's runs are the headline table
        meta, summ = rep["meta"], rep["summary"]
        env = meta["environment"]
        flags = f", {env['cpu_flags']}" if env.get("cpu_flags") else ""
        parts = []
        for name, s in summ.items():
            if s.get("kind") != "method" or not s.get("speedup_vs_hf"):
                continue
            if base_method(name) in ("auto", "ar") or (s.get("backend") == "int8" and base_method(name) == "ar"):
                q = " (**quantised model**)" if s.get("backend") == "int8" else ""
                parts.append(f"`{name}`{q} {s['speedup_vs_hf']:.2f}x `generate` ({s['speedup']:.2f}x `ar`, tau "
                             f"{s['tau']:.2f}, identical to ar {s.get('identical', '-')}, to `generate` "
                             f"{s.get('identical_to_hf', '-')})"
                             + (spread(s) + llama_ratios(rep, s) if base_method(name) == "auto" else ""))
        if parts:
            out.append(f"- **{meta['model']}**, {meta['prompts']} built-in chat prompts × "
                       f"{meta['generation']['max_new_tokens']} tokens, greedy, one process "
                       f"({env['machine'].split('|')[0]}{flags}, {env['machine'].split('|')[1]}; "
                       f"`{rep['dir'].name}`): " + "; ".join(parts) + ".")
    if not out:
        return ""
    if int8:
        return ("Quantised, **not** the fp32 model's output (`--kernels int8`: lossless with respect to the int8 "
                "model; its quality cost is in `docs/performance.md`):\n\n" + "\n".join(out) + "\n\n")
    return ("With no flags (`scripts/bench_defaults.sh`: default kernels `auto`, default method `auto`, "
            "against `transformers` `generate` in fp32 on stock kernels, in the same run):\n\n" + "\n".join(out)
            + "\n\n")


T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided t, df = n - 1


def per_repeat_rates(records: list[dict]) -> dict[str, dict[int, float]]:
    """tokens/s of every method and peer in every repeat (summed over the run's prompts)."""
    tok: dict[tuple[str, int], float] = {}
    sec: dict[tuple[str, int], float] = {}
    for r in records:
        if r.get("error") or not r.get("wall_s"):
            continue
        key = (r["method"], r.get("repeat", 0))
        tok[key] = tok.get(key, 0.0) + r.get("new_tokens", 0)
        sec[key] = sec.get(key, 0.0) + r["wall_s"]
    out: dict[str, dict[int, float]] = {}
    for (m, rep), t in tok.items():
        out.setdefault(m, {})[rep] = t / sec[(m, rep)]
    return out


def ratios(rates: dict[str, dict[int, float]], a: str, b: str) -> list[float]:
    """The ratio of ``a`` to ``b`` in each repeat both ran (empty: not both measured)."""
    reps = sorted(set(rates.get(a, {})) & set(rates.get(b, {})))
    return [rates[a][r] / rates[b][r] for r in reps]


def ratio_mean(rates: dict[str, dict[int, float]], a: str, b: str) -> float | None:
    """mean ratio of ``a`` to ``b`` over the repeats both ran (None: not both measured)."""
    vals = ratios(rates, a, b)
    return round(sum(vals) / len(vals), 3) if vals else None


def ratio_ci(rates: dict[str, dict[int, float]], a: str, b: str) -> str:
    """mean ratio of ``a`` to ``b`` over the repeats both ran, with a 95% t interval (n >= 2)."""
    vals = ratios(rates, a, b)
    if not vals:
        return "-"
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return f"{mean:.2f}x (1 repeat)"
    sd = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
    half = T95.get(len(vals) - 1, 2.0) * sd / len(vals) ** 0.5
    return f"**{mean:.2f}x** [{mean - half:.2f}, {mean + half:.2f}]"


MEASURED_FILE = Path("src/selfspec/data/measured_defaults.json")
"""The headline figures as data the package ships: ``selfspec demo`` on a fresh machine says what the
default measured after ``selfspec compile`` on this CPU family (``selfspec.cli.demo``)."""
STAGES = ("fresh", "compiled")
"""A CPU family's two headline rows: a fresh machine (``defaults-smollm2-FAMILY-fresh``: README command
1's configuration before ``selfspec compile``) and after it (``defaults-smollm2-FAMILY``)."""
PEER_COLUMNS = (("llama.cpp-f32", "vs llama.cpp F32"), ("llama.cpp-q8_0", "vs llama.cpp Q8_0 (**lossy**)"),
                ("openvino-f32", "vs OpenVINO f32"), ("openvino", "vs OpenVINO default (**lossy**)"))


def stage(rep: dict) -> str:
    """``fresh`` for a fresh-machine defaults run, ``compiled`` for one after ``selfspec compile``."""
    return "fresh" if rep["dir"].name.endswith("-fresh") else "compiled"


def headline(reports: list[dict]) -> tuple[str, dict[str, dict[str, dict]]]:
    """The README's first table: per CPU family, the latest defaults run of the default model on a
    fresh machine and after ``selfspec compile`` (``scripts/bench_defaults.sh``: runs named
    ``defaults-smollm2*``), against ``generate`` and the engines a CPU user would run instead, with
    95% intervals over repeats; and the figures of each row, per family and stage (for
    :data:`MEASURED_FILE`)."""
    latest: dict[tuple[str, str], dict] = {}
    measured: dict[str, dict[str, dict]] = {}  # per family and stage, for MEASURED_FILE
    for rep in reports:
        if not rep["dir"].name.startswith("defaults-smollm2"):
            continue
        env = rep["meta"]["environment"]
        key = (cpu_family(env.get("cpu_flags", ""), env.get("machine", "")), stage(rep))
        recs = read_records(rep["dir"])
        stamps = [r["time"] for r in recs if isinstance(r.get("time"), (int, float))]
        when = time.strftime("%Y-%m-%d", time.gmtime(max(stamps))) if stamps else ""
        rep["when"], rep["records"], rep["last"] = when, recs, max(stamps, default=0.0)
        if key not in latest or rep["last"] > latest[key]["last"]:  # the latest by the clock: two runs a day
            latest[key] = rep
    if not latest:
        return "", measured
    lines = ["| CPU (flags) | machine | default configuration | vs `transformers` `generate` | "
             + " | ".join(label for _, label in PEER_COLUMNS)
             + " | vs `ar` | vs best fixed configuration | identical to `ar` | repeats | measured at |",
             "|---|---|---|---|" + "---|" * len(PEER_COLUMNS) + "---|---|---|---|---|"]
    for fam in (*CPU_FAMILIES, "unknown"):
        for st in STAGES:
            rep = latest.get((fam, st))
            if rep is None:
                continue
            meta, summ = rep["meta"], rep["summary"]
            env = meta["environment"]
            rates = per_repeat_rates(rep["records"])
            auto = next((n for n in summ if base_method(n) == "auto"), None)
            if auto is None:
                continue
            ar = summ[auto].get("baseline", "ar")
            fixed = [n for n, v in summ.items() if v.get("kind") == "method" and base_method(n) != "auto"
                     and v.get("lossless", True) and v.get("backend") != "int8"]
            best = max(fixed, key=lambda n: summ[n]["tokens_per_s"], default=None)
            peers = " | ".join(ratio_ci(rates, auto, p) if p in summ and summ[p].get("tokens_per_s")
                               else ("**failed**" if p in summ else "not measured") for p, _ in PEER_COLUMNS)
            commit = str(env.get("git", "?"))[:12]
            measured.setdefault(fam, {})[st] = {
                "configuration": auto, "vs_generate": ratio_mean(rates, auto, "hf"),
                "vs_ar": ratio_mean(rates, auto, ar), "vs_llama_cpp_f32": ratio_mean(rates, auto, "llama.cpp-f32"),
                "identical_to_ar": summ[auto].get("identical"), "threads": env.get("threads"),
                "run": f"docs/results/{rep['dir'].name}", "commit": commit, "date": rep["when"]}
            machine = "fresh (no `selfspec compile`)" if st == "fresh" else "after `selfspec compile`"
            lines.append(
                f"| {fam} ({env.get('cpu_flags') or 'flags not recorded'}), {env['machine'].split('|')[1]} "
                f"| {machine} | `{auto}` | {ratio_ci(rates, auto, 'hf')} | {peers} "
                f"| {ratio_ci(rates, auto, ar)} | {ratio_ci(rates, auto, best) if best else '-'} (`{best}`) "
                f"| {summ[auto].get('identical', '-')} | {meta.get('repeats', 1)} "
                f"| `{commit}`, {rep['when'] or 'date not recorded'} (`{rep['dir'].name}`) |")
    families = {f for f, _ in latest}
    missing = [f for f in CPU_FAMILIES if f not in families]
    no_fresh = [f for f in families if (f, "fresh") not in latest]
    if missing or no_fresh:
        lines.append("")
    if missing:
        lines.append(f"No defaults run of {' or '.join(missing)} is in the tree yet: run "
                     "`bash scripts/bench_defaults.sh` there and `bash scripts/readme_results.sh`.")
    if no_fresh:
        lines.append(f"No fresh-machine row of {' or '.join(sorted(no_fresh))} yet (its runs predate it).")
    return ("**What you get with no flags**, per CPU family met so far (`scripts/bench_defaults.sh`: the default "
            "model SmolLM2-135M-Instruct, 10 built-in chat prompts × 64 tokens, greedy; default kernels and method "
            "`auto`; every figure a ratio of tokens/s measured in the same process, mean over repeats with a 95% "
            "interval; `generate` is `transformers` fp32 on stock kernels; llama.cpp and OpenVINO GenAI run the "
            "same weights on the same prompt ids: llama.cpp on the F32 GGUF is the exact comparison (its ids equal "
            "ours); OpenVINO f32 runs at f32 precision on the GGUF's F16 requantization, our weights rounded to "
            "f16 (it refuses F32 GGUFs; rows measured before that change ran it on SmolLM2's Q4_1 blocks, which it "
            "decompresses into another function: ids apart from ours from the first tokens; docs/benchmark.md); "
            "the columns marked **lossy** change the weights or "
            "the arithmetic). Two rows per family: a fresh "
            "machine (README command 1 before `selfspec compile`: `auto` chooses among the eager backends) and "
            "after `selfspec compile` has saved its steps (`auto` then times the `compiled` backend too). A family "
            "keeps its last run until someone re-measures it.\n\n"
            + "\n".join(lines) + "\n\n"), measured


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["s"].get("speedup")]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.4))
    names = [f"{r['method'].replace(' (int8 model)', '')} · {kernels_of(r['s'])} · "
             f"{r['meta']['model'].replace('-instruct', '')}" for r in rows]
    vals = [r["s"]["speedup"] for r in rows]
    hfs = [r["s"].get("speedup_vs_hf") or 0 for r in rows]
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], vals, height=0.4, label="vs ar (same kernels)", color="#3b75af")
    ax.barh([i - 0.2 for i in y], hfs, height=0.4, label="vs transformers generate (where measured)",
            color="#ef8636")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel("speedup, best measured greedy configuration (int8: a quantised model)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = sys.argv[1:]
    readme = Path(args[0]) if args else Path("README.md")
    dirs = [Path(d) for d in args[1:]] or sorted(p.parent for p in RESULTS.glob("*/report.json"))
    reports = [load(d) for d in dirs]
    # the other models' defaults runs have their own lines above the table; a base model's repetitive text
    # (Gemma-3-270M's) would make the best-of-all rows of prompt lookup say more than any user sees
    rows = best_rows([r for r in reports if not other_model_defaults(r)])
    plot(rows, RESULTS / "summary.png")
    per_run = "\n\n".join(section(r) for r in reports)
    (RESULTS / "README.md").write_text(
        "# Benchmark runs\n\nEvery `selfspec bench` run behind the README's summary, generated by "
        f"`scripts/results_to_readme.py` ({NOTE}). Each directory holds the run's records and report; its plots "
        "are redrawn by `python scripts/replot.py docs/results/RUN` (the tree keeps only the plots the docs show, "
        "to stay small for GPU calls). The first GPU run (NVIDIA H200) is in `gpu-nvidia-h200/`.\n\n"
        "## Each method at its best measured configuration\n\n"
        "One row per method at its best measured greedy configuration over all runs below, on whatever flags "
        "that run passed: **not** what a user gets with no flags (the README's tables are). For comparing "
        "methods, not for quoting.\n\n"
        f"{summary_table(rows)}\n\n![speedups](summary.png)\n\n## Every run\n\n{per_run}\n")
    text = readme.read_text()
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    table, measured = headline(reports)
    body = (f"{table}{defaults_line(reports)}{defaults_line(reports, int8=True)}"
            "Every run in full, and each method at its best measured configuration (on the flags that run passed): "
            "[docs/results/README.md](docs/results/README.md).")
    readme.write_text(f"{head}{START}\n{body}\n{END}{tail}")
    MEASURED_FILE.write_text(json.dumps({
        "note": "generated by scripts/results_to_readme.py from docs/results: per CPU family, the latest defaults run "
                "of the default model (scripts/bench_defaults.sh) on a fresh machine and after `selfspec compile`; "
                "ratios of tokens/s measured in one run, mean over its repeats",
        "model": DEFAULT_MODEL, "families": measured}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
