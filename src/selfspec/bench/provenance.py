"""Where and how bench figures were measured, and which run directories ``--resume`` may continue.

Every record carries the selfspec source revision it was measured at (the git commit and a
dirty flag when the package runs from a git checkout, else the package version), the command
line, the date, the machine id and the CPU flags. A run directory also keeps the identity of its
run (machine, model, prompts, generation settings) in ``meta.json``; ``--resume`` continues it
only when the new command has the same identity, so figures from different machines or
generation settings never mix under one label.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..errors import SelfspecError
from .datasets import Prompt

log = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/selfspec (or site-packages/selfspec)


def _git(args: list[str], cwd: Path) -> str | None:
    """stdout of ``git args`` in ``cwd``; None when git is missing or fails."""
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def package_version() -> str:
    """``selfspec.__version__`` (the package metadata's version; ``0+unknown`` where it has none)."""
    from .. import __version__

    return __version__


def source_revision(package_dir: Path = _PACKAGE_DIR) -> tuple[str, bool | None]:
    """``(commit, dirty)`` of the selfspec source tree when ``package_dir`` is tracked in a git
    checkout (dirty: tracked files differ from the commit); ``("selfspec VERSION", None)`` for an
    installed package, including one that merely lies inside some other repository."""
    if _git(["ls-files", "--error-unmatch", "__init__.py"], package_dir) is not None:
        sha = _git(["rev-parse", "HEAD"], package_dir)
        status = _git(["status", "--porcelain", "--untracked-files=no"], package_dir)
        if sha:
            return sha, (bool(status) if status is not None else None)
    return f"selfspec {package_version()}", None


@dataclass(frozen=True)
class Provenance:
    """What each record of one bench process carries about where it was measured."""

    commit: str
    dirty: bool | None
    command: tuple[str, ...]
    machine: str
    cpu_flags: str

    @classmethod
    def here(cls, command: list[str] | tuple[str, ...]) -> Provenance:
        """The provenance of this process: source revision, ``command``, machine and CPU flags."""
        from ..core.machine import cpu_flags, machine_id

        commit, dirty = source_revision()
        return cls(commit, dirty, tuple(command), machine_id(), cpu_flags())

    def record_fields(self) -> dict:
        """The fields a record gets, with the date (UTC, ISO 8601) it is measured at."""
        return {"commit": self.commit, "dirty": self.dirty, "command": list(self.command),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": self.machine, "cpu_flags": self.cpu_flags}


def prompts_digest(prompts: list[Prompt]) -> str:
    """A short hash of the prompts' ids, texts, turns and chat flags (the prompt set, in order)."""
    rows = [[p.id, p.category, p.text, p.chat, list(p.turns)] for p in prompts]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


_MACHINE_KEYS = ("machine", "cpu_flags")


def _legacy_identity(meta: dict) -> dict:
    """The part of a run identity that a ``meta.json`` written before identities were kept holds."""
    env, gen = meta.get("environment", {}), meta.get("generation", {})
    old = {k: env[k] for k in _MACHINE_KEYS if k in env}
    old.update({k: meta[k] for k in ("model", "draft_model", "dataset", "per_category", "prompts") if k in meta})
    return {**old, **gen}


def check_resumable(out: Path, identity: dict, records: list[dict]) -> None:
    """Raise a one-line :class:`SelfspecError` unless the run in ``out`` was made with ``identity``
    (its ``meta.json``, and the machine of every record that names one); each difference is named."""
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise SelfspecError(f"cannot --resume {out}: its meta.json is missing or unreadable, so which machine and "
                            "settings made it is unknown; start a new run with another --out") from None
    stored = dict(meta.get("identity") or _legacy_identity(meta))
    others = sorted({r["machine"] for r in records if r.get("machine")} - {identity["machine"]})
    if others and stored.get("machine") == identity["machine"]:
        stored["machine"] = others[0]  # a record measured elsewhere
    differ = [k for k in identity if k in stored and stored[k] != identity[k]]
    if not differ:
        log.info("resuming %s (%d records)", out, len(records))
        return
    how = []
    if any(k in _MACHINE_KEYS for k in differ):
        how.append("on another machine")
    if any(k not in _MACHINE_KEYS for k in differ):
        how.append("with another configuration")
    diffs = "; ".join(f"{k} {stored[k]!r} (now {identity[k]!r})" for k in differ)
    raise SelfspecError(f"cannot --resume {out}: it was made {' and '.join(how)}: {diffs}; "
                        "start a new run with another --out")


def commits_of(records: list[dict]) -> list[dict]:
    """The source revisions the records were measured at, most records first: ``commit``,
    ``dirty`` and ``records`` (records from before provenance count as commit ``unknown``)."""
    counts = Counter((r.get("commit", "unknown"), r.get("dirty")) for r in records)
    return [{"commit": c, "dirty": d, "records": n} for (c, d), n in counts.most_common()]


def revision_label(commit: str, dirty: bool | None) -> str:
    """``abc123def456`` (a git sha shortened), ``+dirty`` when tracked files differed."""
    short = commit[:12] if len(commit) == 40 and all(c in "0123456789abcdef" for c in commit) else commit
    return short + ("+dirty" if dirty else "")
