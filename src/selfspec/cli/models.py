"""``selfspec models list | pull | rm``: the bundled models, the GGUF files converted for you, and the
cache they live in."""

from __future__ import annotations

import argparse

from .common import Parser


def add_parser(sub) -> None:
    """Register ``selfspec models`` on the subcommand set ``sub``."""
    m = sub.add_parser("models", help="list, pull or remove models in the cache")
    msub = m.add_subparsers(dest="models_cmd", required=True, parser_class=Parser)
    msub.add_parser("list", help="list bundled models and whether they are pulled")
    pull = msub.add_parser("pull", help="download and convert a bundled model into the cache")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="convert again even if the cache is intact")
    rm = msub.add_parser("rm", help="remove a pulled bundled model or a converted GGUF from the cache")
    rm.add_argument("name", help="a bundled name, a converted model's name (as `models list` shows it), or the "
                                 ".gguf file it was converted from")
    m.set_defaults(func=run)
    for action in msub._choices_actions:
        if msub.choices[action.dest].description is None:
            msub.choices[action.dest].description = action.help


def run(args: argparse.Namespace) -> int:
    from .. import paths
    from ..models import bundled, loading

    if args.models_cmd == "pull":
        path = bundled.pull(args.name, force=args.force)
        print(path)
        return 0
    if args.models_cmd == "rm":
        return remove(args.name)
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
    converted = loading.converted_models()
    if converted:
        print("converted from GGUF (selfspec models rm NAME frees the space):")
    for d, size in converted:
        origin = _origin(d)
        print(f"  {d.name:40s} {size / 2**30:6.2f} GiB  {origin}")
    print(f"cache: {paths.selfspec_home()} (set SELFSPEC_HOME to move it)")
    w = paths.writable_cache_dir("profiles")
    if w != paths.selfspec_home() / "profiles":  # a read-only (shared) home: used read-only
        print(f"the cache is read-only: cost profiles and choices go to {w.parent if w else 'nowhere (not cached)'}")
    return 0


def _origin(d) -> str:
    """The GGUF file a converted model came from (its manifest), or ``?``."""
    import json

    from ..models import bundled

    try:
        return json.loads((d / bundled.MANIFEST).read_text()).get("source", {}).get("gguf", "?")
    except (OSError, ValueError, AttributeError):
        return "?"


def remove(name: str) -> int:
    """``selfspec models rm NAME``: delete a pulled bundled model or a converted GGUF's directory."""
    import shutil
    from pathlib import Path

    from ..errors import SelfspecError
    from ..models import bundled, loading

    target: Path | None
    if name in bundled.BUNDLED or name in bundled.FINETUNED:
        target = bundled.model_dir(name)
    elif Path(name).expanduser().suffix == ".gguf" and Path(name).expanduser().is_file():
        target = loading.gguf_cache_dir(Path(name).expanduser())
    else:
        by_name = {d.name: d for d, _ in loading.converted_models()}
        target = by_name.get(name) or by_name.get(Path(name).name)
        if target is None:
            raise SelfspecError(f"no model {name!r} in the cache: `selfspec models list` shows what is there")
    if not target.is_dir():
        raise SelfspecError(f"{name} is not in the cache ({target} does not exist)")
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    shutil.rmtree(target)
    print(f"removed {target} ({size / 2**30:.2f} GiB)")
    return 0
