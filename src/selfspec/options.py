"""The command line's method flags (``--k``, ``--head``, ...), generated from the methods' config
fields (``selfspec.registry``), and the method options they give.

A config field with ``flag`` in its metadata is set by that flag (``selfspec.drafters.spec``
describes the keys); several methods may share a flag, whose help then lists what it means for
each. ``selfspec generate`` / ``demo`` read the flags strictly (a flag the method does not use is
an error), ``selfspec bench`` leniently (each method of ``--methods`` takes the flags it uses).
This module imports the registry only when called, so importing the CLI stays cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from .errors import SelfspecError


@dataclass(frozen=True)
class FlagUse:
    """One method field a flag sets.

    Attributes:
        method: the method (or ``auto``).
        field: the config field.
        help: the field's help.
        default: the field's default.
        value: for a switch, the value it sets; None for a flag that takes a value.
        when, unless: the flag sets this field only when that other flag is / is not given.
    """

    method: str
    field: str
    help: str
    default: object
    value: object = None
    when: str | None = None
    unless: str | None = None


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def flag_uses() -> dict[str, list[FlagUse]]:
    """Every method flag and the fields it sets, in registry order (``auto`` first)."""
    from .registry import AUTO, METHODS, options_class

    out: dict[str, list[FlagUse]] = {}
    for method in (AUTO, *METHODS):
        for f in dataclasses.fields(options_class(method)):
            md = f.metadata
            if "flag" in md:
                out.setdefault(md["flag"], []).append(FlagUse(method, f.name, md.get("help", ""), f.default,
                                                              md.get("value"), md.get("when"), md.get("unless")))
    return out


def _flag_kind(flag: str, uses: list[FlagUse]) -> dict:
    """argparse keywords of ``flag`` from the types of the fields it sets (they must agree)."""
    from .registry import options_class

    switch = {u.value is not None for u in uses}
    if len(switch) != 1:
        raise TypeError(f"{flag}: a switch for some methods and a value for others")
    if switch == {True}:
        return {"action": "store_true"}
    kinds, choices = set(), set()
    for u in uses:
        f = next(f for f in dataclasses.fields(options_class(u.method)) if f.name == u.field)
        kinds.add(str(f.type).partition(" | ")[0])
        if "choices" in f.metadata:
            choices.add(tuple(f.metadata["choices"]))
    if len(kinds) != 1 or len(choices) > 1:
        raise TypeError(f"{flag}: its fields differ in type or choices ({kinds}, {choices})")
    kind = kinds.pop()
    kw: dict = {"default": None, "type": {"int": int, "float": float}.get(kind, str)}
    if choices:
        kw["choices"] = list(choices.pop())
    return kw


def _flag_help(uses: list[FlagUse]) -> str:
    """``"pld, draft-model: HELP (default 10); jacobi: ..."``: what the flag sets for each method
    (methods with the same help and default share one entry)."""
    groups: dict[tuple, list[str]] = {}
    for u in uses:
        groups.setdefault((u.help, u.default, u.value, u.when, u.unless), []).append(u.method)
    parts = []
    for (text, default, value, when, unless), methods in groups.items():
        cond = f" (with {when})" if when else f" (without {unless})" if unless else ""
        shown = value is None and default not in (None, "")
        parts.append(f"{', '.join(methods)}{cond}: {text}{f' (default {default})' if shown else ''}")
    return "; ".join(parts).replace("%", "%%")


def add_method_flags(p: argparse.ArgumentParser) -> None:
    """Add every method flag to ``p``, with help from the config fields it sets."""
    group = p.add_argument_group("method options", "each flag sets an option of the methods it names")
    for flag, uses in flag_uses().items():
        group.add_argument(flag, dest=_dest(flag), help=_flag_help(uses), **_flag_kind(flag, uses))


def _given(args: argparse.Namespace, flag: str) -> bool:
    return getattr(args, _dest(flag), None) not in (None, False)


def method_options(args: argparse.Namespace, method: str, strict: bool = True) -> dict:
    """Method keyword options from the method flags in ``args`` (``strict``: refuse flags the
    method does not use)."""
    opts: dict = {}
    for flag, uses in flag_uses().items():
        if not _given(args, flag):
            continue
        mine = [u for u in uses if u.method == method]
        for u in mine:
            if (u.when is None or _given(args, u.when)) and (u.unless is None or not _given(args, u.unless)):
                opts[u.field] = u.value if u.value is not None else getattr(args, _dest(flag))
        if strict and not mine:
            users = list(dict.fromkeys(u.method for u in uses))
            raise SelfspecError(f"{flag} does not apply to --method {method}; it sets options of "
                                f"{', '.join(users)}")
    return opts
