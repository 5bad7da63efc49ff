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


def plot_all(out: Path, summary: dict, records: list[dict], profiles: dict[str, dict] | None,
             title: str) -> list[Path]:
    """Write the plots into ``out``; returns their paths."""
    plt = _plt()
    paths = []
    names = [n for n, s in summary.items() if n != "ar" and s.get("baseline", "ar") != n]

    # 1. speedup by category and method
    cats = sorted({c for s in summary.values() for c in s["by_category"]})
    if names and cats:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) + 2), 4))
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            vals = [summary[n]["by_category"].get(c) or 0 for c in cats]
            ax.bar([x + i * width for x in range(len(cats))], vals, width, label=n)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cats))], cats, rotation=30, ha="right")
        ax.set_ylabel("speedup vs ar (tokens/s ratio)")
        ax.set_title(f"{title}: speedup by category")
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / "speedup_by_category.png"))

    # 2. overall speedup and tau per method
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    all_names = list(summary)
    a1.bar(all_names, [summary[n]["speedup"] or 0 for n in all_names], color="tab:blue")
    a1.axhline(1.0, color="black", lw=0.8, ls="--")
    a1.set_ylabel("speedup vs ar")
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
    methods = [n for n in summary if summary[n].get("tau") and n != "ar"]
    if methods:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        width = 0.8 / len(methods)
        top = 1
        for i, n in enumerate(methods):
            c = Counter(x for r in records if r["method"] == n
                        for x, d in zip(r.get("committed_per_step", [])[1:], r.get("drafted_per_step", [])[1:]) if d)
            total = sum(c.values()) or 1
            top = max(top, max(c, default=1))
            ax.bar([k + i * width for k in sorted(c)], [c[k] / total for k in sorted(c)], width, label=n)
        ax.set_xticks(range(1, top + 1))
        ax.set_xlabel("tokens committed in one verify step (accepted drafts + 1)")
        ax.set_ylabel("fraction of steps that verified drafts")
        ax.set_title(f"{title}: accepted length per step")
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / "accepted_length_hist.png"))

    # 4. the verify cost profile T(q) per kernels backend on this machine
    if profiles:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        top = 0.0
        for backend, prof in profiles.items():
            qs, ts = prof["qs"], prof["seconds"]
            ax.plot(qs, [t * 1000 for t in ts], marker="o", label=f"{backend}: T(8)/T(1) = "
                    f"{ts[qs.index(8)] / ts[0]:.2f}" if 8 in qs else backend)
            top = max(top, max(ts) * 1000)
        ax.set_ylim(0, top * 1.2)
        ax.set_xlabel("tokens verified in one forward (q)")
        ax.set_ylabel("ms per target forward")
        ax.set_title("verify cost T(q) per kernels backend")
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / "cost_profile.png"))
    return paths
