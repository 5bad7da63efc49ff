"""A benchmark run's records on disk: one JSON object per generation, one per line.

A run writes ``records.jsonl`` (appended as it goes; ``--resume`` continues it). Runs kept in the
repository are packed to ``records.jsonl.gz`` (:func:`pack`, ``scripts/pack_results.py``): the
records are token ids and per-step figures, about 12x smaller compressed, and a GPU call carries
the whole tracked tree. Every reader goes through :func:`read_records`, which reads either.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

RECORDS = "records.jsonl"
PACKED = RECORDS + ".gz"


def records_file(run: Path) -> Path | None:
    """The records of the run in directory ``run``: ``records.jsonl`` (a run being written or
    resumed), else ``records.jsonl.gz`` (packed), else None."""
    for name in (RECORDS, PACKED):
        if (run / name).is_file():
            return run / name
    return None


def read_records(run: Path) -> list[dict]:
    """Every record of the run in ``run``, in file order; a line cut by an interrupt is skipped.
    Raises FileNotFoundError where the run has no records."""
    path = records_file(run)
    if path is None:
        raise FileNotFoundError(f"{run} has no {RECORDS} or {PACKED}")
    text = gzip.decompress(path.read_bytes()).decode() if path.name == PACKED else path.read_text()
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def pack(run: Path) -> int:
    """Compress the run's ``records.jsonl`` to ``records.jsonl.gz`` (the same bytes each time:
    no name or time in the header) and remove the plain file. Returns the bytes saved (0 where
    there is nothing to pack)."""
    plain = run / RECORDS
    if not plain.is_file():
        return 0
    data = plain.read_bytes()
    packed = gzip.compress(data, compresslevel=9, mtime=0)
    tmp = run / (PACKED + ".tmp")
    tmp.write_bytes(packed)
    tmp.replace(run / PACKED)
    plain.unlink()
    return len(data) - len(packed)
