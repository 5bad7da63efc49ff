"""Summaries of bench records: tokens/s, speedup against ``ar``, tau, and greedy equality."""

from __future__ import annotations

import json
import shlex
import statistics
from collections import defaultdict
from pathlib import Path

from ..core.acceptance import acceptance_by_depth as core_acceptance_by_depth
from .provenance import revision_label


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _compare(rs: list[dict], ref_ids: dict) -> tuple[int, list[dict]]:
    """How many of ``rs`` have exactly the token ids of the reference run on the same prompt."""
    same, diffs = 0, []
    for r in rs:
        ref = ref_ids.get((r["prompt_id"], r["repeat"]))
        if ref is None:
            continue
        d = _first_diff(ref, r["token_ids"])
        if d is None:
            same += 1
        else:
            diffs.append({"prompt_id": r["prompt_id"], "repeat": r["repeat"], "position": d})
    return same, diffs


def acceptance_by_depth(records: list[dict]) -> list[float]:
    """Acceptance at each draft depth over ``records`` (the one definition,
    :func:`selfspec.core.acceptance.acceptance_by_depth`), from each record's ``drafted_per_step``
    and ``accepted_per_step``; records made before the latter existed give ``committed - 1`` (a
    step cut by EOS or the length limit then counts as rejections)."""
    depths: list[int] = []
    accepted: list[int] = []
    for r in records:
        d = r.get("drafted_per_step", [])
        a = r.get("accepted_per_step") or [max(c - 1, 0) for c in r.get("committed_per_step", [])]
        n = min(len(d), len(a))
        depths += d[:n]
        accepted += a[:n]
    return core_acceptance_by_depth(depths, accepted)


def summarize(records: list[dict], names: list[str], baselines: dict[str, str] | None = None) -> dict:
    """Per method: tokens, wall, tok/s, speedup vs its baseline (``ar`` on the same kernels
    backend, by default ``ar``; ratio of tok/s over the same prompts), speedup vs the fastest
    ``ar`` of the run (``ar`` on whichever kernels backend was fastest: the honest "faster than
    plain decoding" figure), speedup vs the ``hf`` peer when it ran, tau, per-category speedup
    (against the fastest ``ar`` too) and, in greedy runs, how many outputs equal the baseline's
    (and ``hf``'s)."""
    baselines = baselines or {}
    by = defaultdict(list)
    for r in records:
        by[r["method"]].append(r)
    greedy = all(r.get("temperature", 0) == 0 for r in records)
    # coupled sampling makes every method's text a function of (seed, prompt): ids comparable to ar's
    same_text = all(r.get("temperature", 0) == 0 or r.get("sampling") == "coupled"
                    for r in records if r.get("kind", "method") == "method")

    def tps(rs: list[dict]) -> float:
        wall = sum(r["wall_s"] for r in rs)
        return sum(r["new_tokens"] for r in rs) / wall if wall else 0.0

    def ids_of(name: str) -> dict:
        return {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in by.get(name, [])}

    hf_tps = tps(by["hf"]) if by.get("hf") else None
    ars = [n for n in by if n.split("@", 1)[0] == "ar"]
    fastest = max(ars, key=lambda n: tps(by[n])) if ars else None
    fastest_tps = tps(by[fastest]) if fastest else None
    fastest_cat: dict[str, list] = defaultdict(list)
    for r in by.get(fastest, []) if fastest else []:
        fastest_cat[r["category"]].append(r)
    out = {}
    for name in names:
        rs = by.get(name, [])
        if not rs:
            continue
        base = baselines.get(name, "ar")
        base_rs = by.get(base, [])
        base_tps = tps(base_rs)
        s: dict = {"runs": len(rs), "tokens": sum(r["new_tokens"] for r in rs),
                   "wall_s": sum(r["wall_s"] for r in rs), "tokens_per_s": tps(rs),
                   "kind": rs[0].get("kind", "method"), "lossless": all(r.get("lossless", True) for r in rs),
                   "backend": rs[0].get("backend", "stock"), "baseline": base}
        s["speedup"] = s["tokens_per_s"] / base_tps if base_tps else None
        s["speedup_vs_hf"] = s["tokens_per_s"] / hf_tps if hf_tps else None
        s["fastest_ar"] = fastest
        s["speedup_vs_fastest_ar"] = s["tokens_per_s"] / fastest_tps if fastest_tps else None
        s["median_tokens_per_s"] = statistics.median(r["new_tokens"] / r["wall_s"] for r in rs if r["wall_s"])
        s["contended_runs"] = sum(1 for r in rs if r.get("contended"))  # timed while the machine was busy
        steps = sum(r.get("steps", 0) for r in rs)
        s["tau"] = s["tokens"] / steps if steps else None
        s["acceptance_by_depth"] = acceptance_by_depth(rs)
        drafting = [n for r in rs for n in r.get("drafted_per_step", [])[1:]]
        s["drafting_steps"] = sum(1 for n in drafting if n) / len(drafting) if drafting else None
        spent = sum(r.get("draft_s", 0.0) + r.get("verify_s", 0.0) for r in rs)
        s["draft_share"] = sum(r.get("draft_s", 0.0) for r in rs) / spent if spent else None
        cats, base_cat = defaultdict(list), defaultdict(list)
        for r in rs:
            cats[r["category"]].append(r)
        for r in base_rs:
            base_cat[r["category"]].append(r)
        s["by_category"] = {c: (tps(v) / tps(base_cat[c]) if base_cat.get(c) and tps(base_cat[c]) else None)
                            for c, v in sorted(cats.items())}
        s["by_category_vs_fastest_ar"] = {
            c: (tps(v) / tps(fastest_cat[c]) if fastest_cat.get(c) and tps(fastest_cat[c]) else None)
            for c, v in sorted(cats.items())}
        if base_rs and (greedy or (same_text and s["kind"] == "method")):
            same, diffs = _compare(rs, ids_of(base))
            s["identical"] = f"{same}/{same + len(diffs)}"
            s["differences"] = diffs
        if greedy and by.get("hf") and name != "hf":
            same, diffs = _compare(rs, ids_of("hf"))
            s["identical_to_hf"] = f"{same}/{same + len(diffs)}"
        out[name] = s
    return out


def _fastest_words(summary: dict) -> str:
    """``ar@onednn`` at 31.2 tok/s, or that no ``ar`` ran."""
    fastest = next((s.get("fastest_ar") for s in summary.values() if s.get("fastest_ar")), None)
    if fastest is None or fastest not in summary:
        return "no `ar` ran"
    return f"`{fastest}` at {summary[fastest]['tokens_per_s']:.2f} tok/s"


def failure_summary(records: list[dict], name: str) -> dict:
    """The summary of a peer with a failed run (a crash): how many of its runs failed and why,
    and no figure (its tok/s over the runs that survived would not be over the same prompts)."""
    rs = [r for r in records if r["method"] == name]
    bad = [r for r in rs if r.get("failure")]
    return {"runs": len(rs), "failed_runs": len(bad), "failure": bad[0]["failure"] if bad else None,
            "kind": rs[0].get("kind", "peer") if rs else "peer", "lossless": True, "backend": "stock",
            "baseline": "ar", "tokens": sum(r["new_tokens"] for r in rs), "wall_s": None, "tokens_per_s": None,
            "speedup": None, "speedup_vs_hf": None, "tau": None, "by_category": {}, "acceptance_by_depth": []}


def contended_lines(meta: dict, summary: dict) -> list[str]:
    """A paragraph that flags the timings as noisy when the machine was busy with other work
    (``environment.contended``, or records timed while contended); nothing otherwise."""
    busy = {n: s["contended_runs"] for n, s in summary.items() if s.get("contended_runs")}
    if not meta.get("environment", {}).get("contended") and not busy:
        return []
    load = meta.get("load") or {}
    peak = max((v for v in (load.get("load_before"), load.get("load_after")) if v is not None), default=None)
    where = f" (1-min load up to {peak:.1f} on {load.get('machine_cores')} cores)" if peak is not None else ""
    runs = ", ".join(f"{n} {k}/{summary[n]['runs']}" for n, k in busy.items()) or "none singled out"
    return [f"**Contended: the machine was busy with other work during this run{where}; tok/s and speedups are "
            f"noisy.** Timed runs while busy: {runs}.", ""]


def sampling_note(g: dict) -> str:
    """`` (sampling coupled, seed 0)`` when the run sampled; empty for greedy runs."""
    if not g.get("temperature"):
        return ""
    extra = f", top-p {g['top_p']}" if g.get("top_p", 1.0) < 1.0 else ""
    extra += f", top-k {g['top_k']}" if g.get("top_k") else ""
    return f"{extra} (sampling {g.get('sampling', 'rejection')}, seed {g.get('seed')})"


def machine_words(env: dict) -> str:
    """The machine as a reader wants it (``Intel Xeon ..., 2 threads, avx2+avx512f``), not the
    cost-profile cache key it is recorded as (``CPU|threads=2|torch=2.x``)."""
    cpu, *rest = str(env.get("machine", "")).split("|")
    threads = env.get("threads") or next((r.split("=", 1)[1] for r in rest if r.startswith("threads=")), None)
    flags = env.get("cpu_flags")
    return cpu + (f", {threads} threads" if threads else "") + (f", {flags}" if flags else "")


def provenance_lines(meta: dict) -> list[str]:
    """Which selfspec revision(s) the records were measured at (each record keeps its own, so a
    resumed run across commits says so) and the command that made the run."""
    commits = meta.get("commits")
    if not commits:
        env = meta.get("environment", {})
        commits = [{"commit": env.get("git") or "unknown", "dirty": env.get("dirty"), "records": None}]
    if len(commits) == 1:
        c = commits[0]
        lines = [f"Measured at {revision_label(c['commit'], c['dirty'])}."]
    else:
        lines = ["Measured at " + str(len(commits)) + " revisions (a resumed run): " + ", ".join(
            f"{revision_label(c['commit'], c['dirty'])} ({c['records']} records)" for c in commits) + "."]
    if meta.get("command"):
        lines[0] += " Command: `" + " ".join(shlex.quote(a) for a in meta["command"]) + "`."
    return [*lines, ""]


def peer_lines(meta: dict) -> list[str]:
    """What the worker peers (llama.cpp, OpenVINO) ran: each one's GGUF, its engine's description
    of it, whether it is lossy, and the engine's version (``meta["peer_info"]``); nothing when none ran."""
    info = {n: i for n, i in (meta.get("peer_info") or {}).items() if i}
    lines = []
    for engine, package in (("llama.cpp", "llama-cpp-python"), ("openvino", "openvino-genai")):
        mine = {n: i for n, i in info.items() if i.get("engine", "llama.cpp") == engine}
        if not mine:
            continue
        parts = [f"{n} on `{Path(i['gguf']).name}`" + (f" ({i['desc']})" if i.get("desc") else "")
                 + (" (**lossy**)" if i.get("lossy", n == "llama.cpp") else "") for n, i in mine.items()]
        version = next((i.get("version") or i.get("llama_cpp") for i in mine.values()
                        if i.get("version") or i.get("llama_cpp")), "?")
        lines.append(f"{engine} peers ({package} {version}, {next(iter(mine.values())).get('threads')} threads, "
                     f"greedy on the same prompt ids): " + ", ".join(parts) + ".")
    return [*lines, ""] if lines else []


def write_report(out: Path, meta: dict, summary: dict) -> None:
    (out / "report.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    env = meta["environment"]
    g = meta["generation"]
    lines = [
        f"# selfspec bench: {meta['model']}",
        "",
        f"Dataset `{meta['dataset']}` ({meta['prompts']} prompts), max_new_tokens {g['max_new_tokens']}, "
        f"temperature {g['temperature']}{sampling_note(g)}, repeats {meta['repeats']}. Machine: {machine_words(env)}; "
        f"torch {env['torch']}, transformers {env['transformers']}.",
        "",
        *provenance_lines(meta),
        *peer_lines(meta),
        "`vs fastest ar` is against the fastest `ar` of this run (" + _fastest_words(summary) + "), the figure "
        "to quote; `vs ar (same kernels)` against `ar` on the method's own kernels backend; `vs hf` against "
        "`transformers` `generate` (fp32, stock kernels). `int8` is a quantised model: its methods are lossless "
        "with respect to the int8 model, not to the fp32 one (its quality cost is in docs/performance.md).",
        "",
        *contended_lines(meta, summary),
        "| method | kernels | kind | lossless | tokens | tok/s | vs fastest ar | vs ar (same kernels) | vs hf | tau "
        "| identical to ar | identical to hf | pass@1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        if s.get("failure"):
            failed = f"**failed** ({s['failed_runs']}/{s['runs']} runs)"
            lines.append(f"| {name} | {s.get('backend', 'stock')} | {s['kind']} | - | - | {failed} | - | - | - | - | - "
                         "| - | - |")
            continue
        sp = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        sf = f"{s['speedup_vs_fastest_ar']:.2f}x" if s.get("speedup_vs_fastest_ar") is not None else "-"
        sh = f"{s['speedup_vs_hf']:.2f}x" if s.get("speedup_vs_hf") is not None else "-"
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
        lossless = "yes" if s["lossless"] else "**NO**"
        p1 = f"{s['pass@1']:.3f}" if "pass@1" in s else "-"
        backend = "int8 (quantised)" if s.get("backend") == "int8" else s.get("backend", "stock")
        lines.append(f"| {name} | {backend} | {s['kind']} | {lossless} | {s['tokens']} | {s['tokens_per_s']:.2f} "
                     f"| {sf} | {sp} | {sh} | {tau} | {s.get('identical', '-')} | {s.get('identical_to_hf', '-')} "
                     f"| {p1} |")
    cats = sorted({c for s in summary.values() for c in s["by_category"]})
    if len(cats) > 1:
        lines += ["", "Speedup by category, against the fastest `ar`:", "", "| method | " + " | ".join(cats) + " |",
                  "|---|" + "---|" * len(cats)]
        for name, s in summary.items():
            vals = s.get("by_category_vs_fastest_ar") or s["by_category"]
            cells = [f"{vals.get(c):.2f}" if vals.get(c) else "-" for c in cats]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    drafters = {n: s for n, s in summary.items() if s.get("acceptance_by_depth")}
    if drafters:
        depth = min(8, max(len(s["acceptance_by_depth"]) for s in drafters.values()))
        lines += ["", "Acceptance by draft depth (accepted / verified at that depth), share of decode steps that "
                  "drafted, and share of decode time spent drafting:", "",
                  "| method | " + " | ".join(f"d{i + 1}" for i in range(depth)) + " | drafting steps | draft time |",
                  "|---|" + "---|" * (depth + 2)]
        for name, s in drafters.items():
            acc = s["acceptance_by_depth"]
            cells = [f"{acc[i]:.2f}" if i < len(acc) else "-" for i in range(depth)]
            ds = f"{s['drafting_steps']:.2f}" if s.get("drafting_steps") is not None else "-"
            dt = f"{s['draft_share']:.2f}" if s.get("draft_share") is not None else "-"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {ds} | {dt} |")
    failures = {n: s for n, s in summary.items() if s.get("failure")}
    if failures:
        lines += ["", "Failed peers (no figures: a crash is never a measurement):", ""]
        lines += [f"- {n}: {s['failed_runs']} of {s['runs']} runs failed; first: {s['failure']}"
                  for n, s in failures.items()]
    diffs = {n: s["differences"] for n, s in summary.items() if s.get("differences")}
    if diffs:
        lines += ["", "Greedy outputs that differ from ar on the same backend (first differing position):", ""]
        for n, d in diffs.items():
            seen: dict[tuple, list] = {}  # one entry per prompt and position, however many repeats
            for x in d:
                seen.setdefault((x["prompt_id"], x["position"]), []).append(x)
            lines.append(f"- {n}: " + ", ".join(
                f"{xs[0]['prompt_id']} at token {xs[0]['position']}"
                + (f" (ar's top-2 logit gap there: {xs[0]['ar_top2_gap']:.2e})" if "ar_top2_gap" in xs[0] else "")
                + (f" in {len(xs)} repeats" if len(xs) > 1 else "")
                for xs in seen.values()))
    if any("pass@1" in s for s in summary.values()):
        same = all(s.get("pass@1") == summary.get(s["baseline"], {}).get("pass@1")
                   for s in summary.values() if "pass@1" in s and s["kind"] == "method")
        lines += ["", f"HumanEval pass@1 equal to ar's on the same backend for every method: {'yes' if same else 'NO'}"]
    plots = [p for p in ("speedup_by_category.png", "speedup_tau.png", "accepted_length_hist.png", "cost_profile.png")
             if (out / p).exists()]
    if plots:
        lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in plots)]
    (out / "report.md").write_text("\n".join(lines) + "\n")
