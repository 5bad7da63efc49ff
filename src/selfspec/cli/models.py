"""``selfspec models list | pull``: the bundled models and the cache they are pulled into."""

from __future__ import annotations

import argparse

from .common import Parser


def add_parser(sub) -> None:
    """Register ``selfspec models`` on the subcommand set ``sub``."""
    m = sub.add_parser("models", help="list or pull bundled models")
    msub = m.add_subparsers(dest="models_cmd", required=True, parser_class=Parser)
    msub.add_parser("list", help="list bundled models and whether they are pulled")
    pull = msub.add_parser("pull", help="download and convert a bundled model into the cache")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="convert again even if the cache is intact")
    m.set_defaults(func=run)
    for action in msub._choices_actions:
        if msub.choices[action.dest].description is None:
            msub.choices[action.dest].description = action.help


def run(args: argparse.Namespace) -> int:
    from .. import paths
    from ..models import bundled

    if args.models_cmd == "pull":
        path = bundled.pull(args.name, force=args.force)
        print(path)
        return 0
    for name, m in bundled.BUNDLED.items():
        d = bundled.model_dir(name)
        state = "pulled" if (d / bundled.MANIFEST).is_file() else "not pulled"
        default = " (default)" if name == bundled.DEFAULT_MODEL else ""
        print(f"{name:30s} {state:11s} {m.family:6s} {m.license:22s} {m.note}{default}")
    for name, f in bundled.FINETUNED.items():
        d = bundled.model_dir(name)
        state = "pulled" if (d / bundled.MANIFEST).is_file() else "not pulled"
        shipped = "" if (bundled.adapter_dir(name) / "selfspec_finetune.json").is_file() else f" [build: {f.build}]"
        print(f"{name:30s} {state:11s} {f.method:6s} {'(base licence)':22s} {f.note}{shipped}")
    print(f"cache: {paths.selfspec_home()} (set SELFSPEC_HOME to move it)")
    w = paths.writable_cache_dir("profiles")
    if w != paths.selfspec_home() / "profiles":  # a read-only (shared) home: used read-only
        print(f"the cache is read-only: cost profiles and choices go to {w.parent if w else 'nowhere (not cached)'}")
    return 0
