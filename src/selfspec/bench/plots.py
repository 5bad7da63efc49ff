"""PNG plots of a bench run: speedup by category, tau, accepted-length histogram, cost profile."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..errors import missing_dependency


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise missing_dependency("matplotlib", "bench", "bench plots") from e
    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def is_baseline(name: str, s: dict) -> bool:
    """``ar`` on any kernels backend (``ar``, ``ar@onednn``): the 1.0 every speedup is against."""
    return s.get("baseline", "ar") == name or name.split("@", 1)[0] == "ar"


def category_speedups(s: dict) -> dict:
    """A summary entry's speedups by category against the fastest ``ar`` of the run (older
    summaries: against ``ar`` on its own kernels)."""
    return s.get("by_category_vs_fastest_ar") or s.get("by_category", {})


def overall_speedup(s: dict) -> float | None:
    """A summary entry's speedup against the fastest ``ar`` of the run (older summaries: its own)."""
    v = s.get("speedup_vs_fastest_ar")
    return v if v is not None else s.get("speedup")


def baseline_words(summary: dict) -> str:
    """What the plots' 1.0 is: ``the fastest ar (ar@onednn)``."""
    fastest = next((s.get("fastest_ar") for s in summary.values() if s.get("fastest_ar")), None)
    return f"the fastest ar ({fastest})" if fastest else "ar"


def series_label(name: str, s: dict) -> str:
    """A series' legend label: its name, marked when some of its runs were timed on a busy machine."""
    busy = s.get("contended_runs") or 0
    return f"{name} [contended {busy}/{s.get('runs')}]" if busy else name


def speedup_series(summary: dict) -> list[str]:
    """The methods and peers drawn in the speedup-by-category plot: not a baseline, and with a
    speedup in some category (a peer without its baseline drew a name with no bar)."""
    return [n for n, s in summary.items() if not is_baseline(n, s)
            and any(v is not None for v in category_speedups(s).values())]


def histogram_series(summary: dict, records: list[dict]) -> dict[str, Counter]:
    """Per method that verified drafts: how many tokens each such step committed (the baselines,
    which never draft, drew an empty legend entry)."""
    out = {}
    for n, s in summary.items():
        if not s.get("tau") or is_baseline(n, s):
            continue
        c = Counter(x for r in records if r["method"] == n
                    for x, d in zip(r.get("committed_per_step", [])[1:], r.get("drafted_per_step", [])[1:]) if d)
        if c:
            out[n] = c
    return out


def bar_offsets(count: int, width: float) -> list[float]:
    """Offsets of ``count`` side-by-side bars of ``width`` centred on their tick."""
    return [(i - (count - 1) / 2) * width for i in range(count)]


def plot_all(out: Path, summary: dict, records: list[dict], profiles: dict[str, dict] | None,
             title: str) -> list[Path]:
    """Write the plots into ``out``; returns their paths."""
    plt = _plt()
    paths = []
    names = speedup_series(summary)

    # 1. speedup by category and method
    base = baseline_words(summary)
    busy = any(s.get("contended_runs") for s in summary.values())
    if busy:
        title = f"{title} [CONTENDED: noisy timings]"
    cats = sorted({c for n in names for c in category_speedups(summary[n])})
    if names and cats:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) + 2), 4))
        width = 0.8 / len(names)
        for n, dx in zip(names, bar_offsets(len(names), width)):
            vals = [category_speedups(summary[n]).get(c) or 0 for c in cats]
            ax.bar([x + dx for x in range(len(cats))], vals, width, label=series_label(n, summary[n]),
                   hatch="//" if summary[n].get("contended_runs") else None)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
        ax.set_ylabel(f"speedup vs {base}")
        ax.set_title(f"{title}: speedup by category")
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / "speedup_by_category.png"))

    # 2. overall speedup and tau per method
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    all_names = [n for n in summary if overall_speedup(summary[n]) is not None]
    a1.bar(all_names, [overall_speedup(summary[n]) for n in all_names], color="tab:blue",
           hatch=["//" if summary[n].get("contended_runs") else "" for n in all_names])
    a1.axhline(1.0, color="black", lw=0.8, ls="--")
    a1.set_ylabel(f"speedup vs {base}")
    a1.set_title("overall speedup")
    taus = [(n, summary[n]["tau"]) for n in all_names if summary[n].get("tau")]
    a2.bar([n for n, _ in taus], [t for _, t in taus], color="tab:green")
    a2.set_ylabel("tau (tokens per target forward)")
    a2.set_title("mean accepted length")
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    paths.append(_save(plt, fig, out / "speedup_tau.png"))

    # 3. tokens committed per step (acceptance-length histogram)
    hist = histogram_series(summary, records)
    if hist:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        width = 0.8 / len(hist)
        top = 1
        for (n, c), dx in zip(hist.items(), bar_offsets(len(hist), width)):
            total = sum(c.values())
            top = max(top, max(c))
            ax.bar([k + dx for k in sorted(c)], [c[k] / total for k in sorted(c)], width, label=n)
        ax.set_xticks(range(1, top + 1))
        ax.set_xlabel("tokens committed in one verify step (accepted drafts + 1)")
        ax.set_ylabel("fraction of steps that verified drafts")
        ax.set_title(f"{title}: accepted length per step")
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / "accepted_length_hist.png"))

    # 4. the verify cost profile T(q) per kernels backend on this machine
    if profiles:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        top_ms = 0.0
        for backend, prof in profiles.items():
            qs, ts = prof["qs"], prof["seconds"]
            ax.plot(qs, [t * 1000 for t in ts], marker="o", label=f"{backend}: T(8)/T(1) = "
                    f"{ts[qs.index(8)] / ts[0]:.2f}" if 8 in qs else backend)
            top_ms = max(top_ms, max(ts) * 1000)
        ax.set_ylim(0, top_ms * 1.2)
        ax.set_xlabel("tokens verified in one forward (q)")
        ax.set_ylabel("ms per target forward")
        ax.set_title("verify cost T(q) per kernels backend")
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / "cost_profile.png"))
    return paths
