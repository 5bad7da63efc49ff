"""Pack the records of benchmark runs kept in the repository: ``records.jsonl`` -> ``records.jsonl.gz``.

Records (token ids and per-step figures) are most of a run's bytes and compress about 12x; every
reader (``selfspec.bench.records.read_records``: the reports, plots, README tables and experiments)
reads either form, and ``selfspec bench --resume`` continues a packed run. A run is a directory with
``records.jsonl`` and a ``meta.json`` holding the run's ``generation`` settings (what ``selfspec bench
--out`` writes); other records (an experiment's own format, even beside a hand-written ``meta.json``)
are left alone.

    python scripts/pack_results.py docs/results/NEW_RUN      # after adding a run; or docs/results: all
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from selfspec.bench.records import RECORDS, pack


def is_bench_run(run: Path) -> bool:
    """Whether ``run`` was written by ``selfspec bench --out``: its ``meta.json`` holds ``generation``
    (a hand-written ``meta.json``, which says how an experiment's files were made, does not)."""
    try:
        meta = json.loads((run / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "generation" in meta


def bench_runs(root: Path) -> list[Path]:
    """Every benchmark run directory at or under ``root`` whose records are not packed yet."""
    return sorted(p.parent for p in [root / RECORDS, *root.rglob(RECORDS)] if p.is_file() and is_bench_run(p.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path, help="run directories, or directories holding runs")
    args = p.parse_args(argv)
    saved = 0
    for d in args.dirs:
        for run in bench_runs(d):
            saved += pack(run)
            print(f"packed {run}")
    print(f"{saved / 1e6:.1f} MB saved", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
