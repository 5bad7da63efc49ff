"""Bench provenance: every record names the revision, command, date and machine it was measured
at, and ``--resume`` refuses a run directory from another machine or configuration."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime

import pytest

from selfspec.bench import provenance
from selfspec.bench.provenance import check_resumable, commits_of, revision_label, source_revision
from selfspec.cli import main
from selfspec.errors import SelfspecError


def bench_args(tiny_dir, dataset, out, *extra) -> list[str]:
    return ["bench", "--model", str(tiny_dir), "--methods", "ar", "--kernels", "stock", "--dataset", str(dataset),
            "--max-new-tokens", "4", "--out", str(out), *extra]


def records_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.fixture
def finished_run(tiny_dir, dataset, tmp_path):
    out = tmp_path / "run"
    assert main(bench_args(tiny_dir, dataset, out)) == 0
    return out


def test_records_carry_commit_command_date_and_machine(tiny_dir, dataset, finished_run):
    from selfspec.core.machine import cpu_flags, machine_id

    commit, dirty = source_revision()
    records = records_of(finished_run)
    assert len(records) == 3
    for r in records:
        assert r["commit"] == commit and r["dirty"] == dirty
        assert r["command"] == ["selfspec", *bench_args(tiny_dir, dataset, finished_run)]
        assert datetime.fromisoformat(r["date"]).tzinfo is not None
        assert r["machine"] == machine_id() and r["cpu_flags"] == cpu_flags()
    meta = json.loads((finished_run / "meta.json").read_text())
    assert meta["commits"] == [{"commit": commit, "dirty": dirty, "records": 3}]
    assert meta["environment"]["git"] == commit and meta["environment"]["dirty"] == dirty
    assert meta["cpu_flags"] == cpu_flags()  # at the top level, as every results directory's meta.json has it
    ident = meta["identity"]
    assert ident["max_new_tokens"] == 4 and ident["prompts"] == 3 and ident["machine"] == machine_id()
    md = (finished_run / "report.md").read_text()
    assert f"Measured at {revision_label(commit, dirty)}." in md and "Command: `selfspec bench --model" in md


@pytest.mark.parametrize("change, named", [
    (["--max-new-tokens", "5"], "max_new_tokens 4 (now 5)"),
    (["--temperature", "0.7"], "temperature 0.0 (now 0.7)"),
    (["--top-p", "0.9"], "top_p 1.0 (now 0.9)"),
    (["--top-k", "5"], "top_k 0 (now 5)"),
    (["--limit", "2"], "limit None (now 2)"),
])
def test_resume_refuses_another_generation_config(tiny_dir, dataset, finished_run, capsys, change, named):
    before = (finished_run / "records.jsonl").read_bytes()
    capsys.readouterr()
    args = bench_args(tiny_dir, dataset, finished_run, "--resume")
    i = args.index(change[0]) if change[0] in args else len(args)
    args[i:i + 2 if change[0] in args else i] = change
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "made with another configuration" in err and named in err and "another --out" in err
    assert (finished_run / "records.jsonl").read_bytes() == before  # the refused run is left as it was


def test_resume_refuses_another_prompt_set(tiny_dir, dataset, finished_run, tmp_path, capsys):
    other = tmp_path / "other.jsonl"
    other.write_text(dataset.read_text().replace("w0 w1", "w5 w1"))  # same ids, one prompt edited
    shutil.copy(other, dataset)
    capsys.readouterr()
    assert main(bench_args(tiny_dir, dataset, finished_run, "--resume")) == 2
    assert "prompts_digest" in capsys.readouterr().err
    assert main(bench_args(tiny_dir, other, finished_run, "--resume")) == 2
    err = capsys.readouterr().err
    assert "dataset" in err and "prompts_digest" in err


def test_resume_refuses_another_machine(tiny_dir, dataset, finished_run, monkeypatch, capsys):
    from selfspec.core import machine

    monkeypatch.setattr(machine, "machine_id", lambda: "Intel Xeon|threads=2|torch=2.9")
    monkeypatch.setattr(machine, "cpu_flags", lambda: "avx2+avx512f+amx_int8")
    capsys.readouterr()
    assert main(bench_args(tiny_dir, dataset, finished_run, "--resume")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "made on another machine:" in err
    assert "(now 'Intel Xeon|threads=2|torch=2.9')" in err and "(now 'avx2+avx512f+amx_int8')" in err


def test_resume_keeps_each_records_own_commit(tiny_dir, dataset, finished_run, monkeypatch):
    first = records_of(finished_run)
    (finished_run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first[:2]))
    monkeypatch.setattr(provenance, "source_revision", lambda: ("f" * 40, True))
    assert main(bench_args(tiny_dir, dataset, finished_run, "--resume")) == 0
    records = records_of(finished_run)
    assert [r["commit"] for r in records] == [first[0]["commit"], first[1]["commit"], "f" * 40]
    assert records[:2] == first[:2]  # resumed records are not relabelled
    meta = json.loads((finished_run / "meta.json").read_text())
    assert {(c["commit"], c["records"]) for c in meta["commits"]} == {(first[0]["commit"], 2), ("f" * 40, 1)}
    md = (finished_run / "report.md").read_text()
    assert "Measured at 2 revisions (a resumed run)" in md and "ffffffffffff+dirty (1 records)" in md


def test_check_resumable_without_meta_legacy_meta_and_foreign_records(tmp_path):
    ident = {"machine": "m", "cpu_flags": "avx2", "model": "x", "max_new_tokens": 8, "temperature": 0.0}
    with pytest.raises(SelfspecError, match="meta.json is missing"):
        check_resumable(tmp_path, ident, [])
    legacy = {"model": "x", "generation": {"max_new_tokens": 16, "temperature": 0.0},
              "environment": {"machine": "m"}}
    (tmp_path / "meta.json").write_text(json.dumps(legacy))
    with pytest.raises(SelfspecError, match=r"max_new_tokens 16 \(now 8\)"):
        check_resumable(tmp_path, ident, [])
    legacy["generation"]["max_new_tokens"] = 8
    (tmp_path / "meta.json").write_text(json.dumps(legacy))
    check_resumable(tmp_path, ident, [{"machine": "m"}, {}])  # a legacy run on this machine: continues
    (tmp_path / "meta.json").write_text(json.dumps({"identity": ident}))
    check_resumable(tmp_path, ident, [])
    with pytest.raises(SelfspecError, match="on another machine: machine 'elsewhere' \\(now 'm'\\)"):
        check_resumable(tmp_path, ident, [{"machine": "m"}, {"machine": "elsewhere"}])


def test_commits_of_counts_records_and_labels():
    recs = [{"commit": "a" * 40, "dirty": False}] * 2 + [{"commit": "b" * 40, "dirty": True}, {}]
    assert commits_of(recs)[0] == {"commit": "a" * 40, "dirty": False, "records": 2}
    assert {c["commit"] for c in commits_of(recs)} == {"a" * 40, "b" * 40, "unknown"}
    assert revision_label("b" * 40, True) == "b" * 12 + "+dirty"
    assert revision_label("selfspec 0.1.0", None) == "selfspec 0.1.0"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_source_revision_of_a_checkout_an_installed_package_and_a_foreign_repo(tmp_path):
    def git(*args, cwd=tmp_path):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                              capture_output=True, text=True).stdout.strip()

    pkg = tmp_path / "src" / "selfspec"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    # not a git checkout: the package version
    commit, dirty = source_revision(pkg)
    assert commit.startswith("selfspec ") and dirty is None
    git("init", "-q")
    git("add", "src")
    git("commit", "-qm", "c")
    sha = git("rev-parse", "HEAD")
    assert source_revision(pkg) == (sha, False)
    (tmp_path / "untracked.txt").write_text("bench output\n")
    assert source_revision(pkg) == (sha, False)  # untracked files do not make it dirty
    (pkg / "__init__.py").write_text("x = 2\n")
    assert source_revision(pkg) == (sha, True)
    # an installed package that merely lies inside some other repository (a venv in a project)
    site = tmp_path / "venv" / "site-packages" / "selfspec"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    assert source_revision(site)[0].startswith("selfspec ")
