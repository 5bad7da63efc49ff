"""The checksum manifest of a converted model directory (``selfspec-manifest.json``): the size and
SHA-256 of every file, written once the conversion finished and checked before every load, so a
corrupt or truncated cache is converted again, never used."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "selfspec-manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _weight_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file() and p.name != MANIFEST)


def write_manifest(d: Path, source: dict) -> None:
    """Record size and SHA-256 of every file in a converted model directory."""
    files = {}
    for p in _weight_files(d):
        files[p.name] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    stamp = {p.name: p.stat().st_mtime_ns for p in _weight_files(d)}
    (d / MANIFEST).write_text(json.dumps({"source": source, "files": files, "verified_mtimes": stamp}, indent=1))


def verify_manifest(d: Path) -> str | None:
    """None if the directory matches its manifest, else a reason.

    Files whose mtime is unchanged since the last full check are trusted; any changed file is
    re-hashed, so a corrupted or truncated file is caught before it is used.
    """
    mf = d / MANIFEST
    if not mf.is_file():
        return "no checksum manifest (conversion did not finish)"
    try:
        man = json.loads(mf.read_text())
    except json.JSONDecodeError:
        return "the checksum manifest is unreadable"
    present = {p.name for p in _weight_files(d)}
    if present != set(man["files"]):
        return "files missing or extra"
    stamps = man.get("verified_mtimes", {})
    for name, info in man["files"].items():
        p = d / name
        if p.stat().st_size != info["size"]:
            return f"{name} has the wrong size"
        if stamps.get(name) != p.stat().st_mtime_ns and _sha256(p) != info["sha256"]:
            return f"{name} fails its SHA-256 check"
    return None
