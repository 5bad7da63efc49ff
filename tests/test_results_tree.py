"""Every result directory says how it was made (issue 60, item 6): each immediate subdirectory of
docs/results has a ``meta.json`` with the command that produced its files, the commit, the CPU
flags and the date, or the directory leaves the tree.

``selfspec bench --out`` writes ``meta.json`` itself (the command as an argv list, the date, the
commit in ``environment.git``; CPU flags in ``environment.cpu_flags``, and at the top level where
added since). Directories written by other scripts carry a hand-written one: ``command`` (a command
line, or an object mapping each run of the directory to its command line), ``commit``, ``date``,
``cpu`` and ``cpu_flags`` (for a GPU run, the host's), and ``source``, where the command was found.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
SHA = re.compile(r"[0-9a-f]{7,40}")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def result_dirs() -> list[Path]:
    if not RESULTS.is_dir():
        pytest.skip("no docs/results here (not a source checkout)")
    return sorted(p for p in RESULTS.iterdir() if p.is_dir())


def filled(value: object) -> bool:
    """A non-empty string; a list of strings with a non-empty one (an argv list may hold an empty
    argument: ``--peers ""``); or a non-empty object of such values."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, dict):
        return bool(value) and all(filled(v) for v in value.values())
    return isinstance(value, list) and all(isinstance(v, str) for v in value) and any(filled(v) for v in value)


def gaps(run: Path) -> list[str]:
    """What ``run``'s meta.json lacks (empty when nothing)."""
    try:
        meta = json.loads((run / "meta.json").read_text())
    except FileNotFoundError:
        return ["meta.json"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"a meta.json that parses ({e})"]
    if not isinstance(meta, dict):
        return ["a meta.json holding an object"]
    missing = [key for key in ("command", "cpu_flags") if not filled(meta.get(key))]
    if not (isinstance(meta.get("date"), str) and DATE.match(meta["date"])):
        missing.append("date")
    env = meta.get("environment")
    commit = meta.get("commit") or (env.get("git") if isinstance(env, dict) else None)
    if not (isinstance(commit, str) and SHA.fullmatch(commit)):
        missing.append("commit")
    return missing


def test_gaps_names_what_is_missing(tmp_path):
    assert gaps(tmp_path) == ["meta.json"]
    (tmp_path / "meta.json").write_text("{")
    assert gaps(tmp_path)[0].startswith("a meta.json that parses")
    (tmp_path / "meta.json").write_text(json.dumps({"command": [], "environment": {"git": "xyz"}}))
    assert gaps(tmp_path) == ["command", "cpu_flags", "date", "commit"]
    (tmp_path / "meta.json").write_text(json.dumps({"command": ["selfspec", "bench", "--peers", ""], "cpu_flags": "",
                                                    "date": "today", "commit": "41709fe"}))
    assert gaps(tmp_path) == ["cpu_flags", "date"]
    (tmp_path / "meta.json").write_text(json.dumps({
        "command": {"run1": "selfspec bench --model m"}, "cpu_flags": ["avx2"], "date": "2026-11-22T03:34:55+00:00",
        "environment": {"git": "41709fe"}}))
    assert gaps(tmp_path) == []


def test_every_result_directory_says_how_it_was_made():
    runs = result_dirs()
    lacking = {run.name: missing for run in runs if (missing := gaps(run))}
    assert not lacking, (
        f"{len(lacking)} of {len(runs)} directories under docs/results do not say how they were made: "
        + "; ".join(f"{name}: no {', no '.join(missing)}" for name, missing in sorted(lacking.items()))
        + ". Add what is missing to the directory's meta.json (command, commit, date, cpu_flags; see this "
          "test's docstring), or take the directory out of the tree.")
