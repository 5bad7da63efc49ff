"""Redraw the plots of ``selfspec bench`` run directories from their records.

The tree keeps each run's records, report and meta, but not the plots of every run (they are
derived, and a GPU call carries the whole tree: keep it small). ``python scripts/replot.py
docs/results/RUN [RUN ...]`` writes the PNGs next to the records again, as the run drew them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from selfspec.bench.plots import plot_all
from selfspec.bench.records import read_records, records_file


def replot(run: Path) -> list[Path]:
    """Plots of the run in ``run`` (``report.json`` + its records, packed or not); returns their paths."""
    report = json.loads((run / "report.json").read_text())
    records = read_records(run)
    meta = report["meta"]
    return plot_all(run, report["summary"], records, meta.get("cost_profiles"), str(meta.get("model", run.name)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (with report.json and records.jsonl)")
    args = p.parse_args(argv)
    for run in args.runs:
        if not (run / "report.json").is_file() or records_file(run) is None:
            print(f"replot: {run} has no report.json + records; skipped", file=sys.stderr)
            continue
        for path in replot(run):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
