"""The tracked tree stays small: a GPU call carries the whole working tree (64 MiB at most), and
wheels must fit beside it (issue 31). Result runs keep packed records, not every plot
(``scripts/replot.py`` redraws them); trained artefacts stay under 10 MB each."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 48 * 10**6  # bytes of tracked files
ARTEFACT_LIMIT = 10 * 10**6


def is_bench_run(run: Path) -> bool:
    """``run`` was written by ``selfspec bench --out`` (as ``scripts/pack_results.py`` decides)."""
    try:
        meta = json.loads((run / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "generation" in meta


def tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_tracked_tree_under_48_mb():
    files = [p for p in tracked() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    biggest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:5]
    assert total < LIMIT, (f"the tracked tree is {total / 1e6:.1f} MB (limit {LIMIT / 1e6:.0f} MB); biggest: "
                           + ", ".join(f"{p.relative_to(ROOT)} {p.stat().st_size / 1e6:.1f} MB" for p in biggest))


def test_no_tracked_file_over_10_mb():
    big = [p for p in tracked() if p.is_file() and p.stat().st_size > ARTEFACT_LIMIT]
    assert not big, f"tracked files over 10 MB: {[str(p.relative_to(ROOT)) for p in big]}"


def test_result_runs_keep_packed_records():
    """Records are most of a benchmark run's bytes and compress about 12x: a run kept under
    docs/results has ``records.jsonl.gz`` (``scripts/pack_results.py``), which every reader reads. A run
    is what ``selfspec bench --out`` writes: its ``meta.json`` holds ``generation``; an experiment's own
    records beside a hand-written ``meta.json`` are not one."""
    plain = [p for p in tracked() if p.name == "records.jsonl" and p.relative_to(ROOT).parts[0] == "docs"
             and is_bench_run(p.parent)]
    assert not plain, (f"unpacked benchmark records: {[str(p.relative_to(ROOT)) for p in plain][:5]}; run "
                       "`python scripts/pack_results.py docs/results` and commit the .gz files")
