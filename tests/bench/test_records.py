"""A run's records read the same packed (``records.jsonl.gz``) as plain, packing is reproducible,
and ``selfspec bench --resume`` continues a packed run."""

from __future__ import annotations

import gzip
import json

import pytest

from selfspec.bench.records import PACKED, RECORDS, pack, read_records, records_file
from selfspec.cli import main

from .test_provenance import bench_args

RECS = [{"prompt_id": "p0", "method": "ar@stock", "token_ids": [1, 2, 3]},
        {"prompt_id": "p1", "method": "ar@stock", "token_ids": [4, 5]}]


def write(run, recs, cut: str = "") -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in recs) + cut)


def test_packed_records_read_as_the_plain_ones(tmp_path):
    run = tmp_path / "run"
    write(run, RECS, cut='{"prompt_id": "p2", "meth')  # a line cut by an interrupt
    assert read_records(run) == RECS
    saved = pack(run)
    assert saved > 0 and records_file(run) == run / PACKED and not (run / RECORDS).exists()
    assert read_records(run) == RECS
    assert pack(run) == 0  # nothing left to pack


def test_plain_records_win_over_packed_ones(tmp_path):
    """A resumed packed run is written plain: the plain file is the newer one."""
    run = tmp_path / "run"
    write(run, RECS[:1])
    pack(run)
    write(run, RECS)
    assert read_records(run) == RECS


def test_packing_gives_the_same_bytes_each_time(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write(a, RECS)
    write(b, RECS)
    pack(a)
    pack(b)
    assert (a / PACKED).read_bytes() == (b / PACKED).read_bytes()
    assert gzip.decompress((a / PACKED).read_bytes()) == "".join(json.dumps(r) + "\n" for r in RECS).encode()


def test_a_run_without_records_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no records.jsonl or records.jsonl.gz"):
        read_records(tmp_path)


def test_bench_resumes_a_packed_run(tiny_dir, dataset, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(bench_args(tiny_dir, dataset, out)) == 0
    full = read_records(out)
    write(out, full[:2])  # as if interrupted after two records, then packed for the repository
    pack(out)
    capsys.readouterr()
    assert main(bench_args(tiny_dir, dataset, out)) == 2  # without --resume: refused, the packed file named
    err = capsys.readouterr().err
    assert PACKED in err and "--resume" in err and err.count("\n") == 1
    assert main(bench_args(tiny_dir, dataset, out, "--resume")) == 0
    again = read_records(out)
    assert again[:2] == full[:2] and len(again) == len(full)
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in full]
    assert records_file(out) == out / RECORDS and not (out / PACKED).exists()
