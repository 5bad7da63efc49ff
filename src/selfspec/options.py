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


def _flag_help(flag: str, every: dict[str, list[FlagUse]]) -> str:
    """What ``flag`` sets for each method, e.g. ``"pld, draft-model (k): HELP (default 10);
    jacobi (m): ..."`` (methods with the same field, help and default share one entry), and for
    which methods it changes what another flag sets."""
    groups: dict[tuple, list[str]] = {}
    for u in every[flag]:  # a switch's entries group by what they set (their fields' help is the option's)
        key = (u.field, "", None, u.value, u.when, u.unless) if u.value is not None else \
            (u.field, u.help, u.default, u.value, u.when, u.unless)
        groups.setdefault(key, []).append(u.method)
    parts = []
    for (field, text, default, value, when, unless), methods in groups.items():
        cond = f", with {when}" if when else f", without {unless}" if unless else ""
        who = ", ".join(methods)
        if value is not None:  # a switch: one entry per field, with its shortest help (it was a paragraph a method)
            short = min((u.help for u in every[flag] if u.field == field and u.help), key=len, default="")
            parts.append(f"{who}: sets {field} to {value}" + (f" ({field}: {short})" if short else ""))
        else:
            shown = default not in (None, "")
            parts.append(f"{who} ({field}{cond}): {text}{f' (default {default})' if shown else ''}")
    for other, uses in every.items():
        for u in uses:
            if u.when == flag:
                parts.append(f"{u.method}: with {flag}, {other} sets {u.field}")
    return "; ".join(parts).replace("%", "%%")


def add_method_flags(p: argparse.ArgumentParser) -> None:
    """Add every method flag to ``p``, with help from the config fields it sets."""
    group = p.add_argument_group("method options", "each flag sets an option of the methods it names (the "
                                                   "option's name in brackets: the API keyword and the key of "
                                                   "selfspec bench --methods METHOD:key=value)")
    every = flag_uses()
    for flag, uses in every.items():
        group.add_argument(flag, dest=_dest(flag), help=_flag_help(flag, every), **_flag_kind(flag, uses))


def _given(args: argparse.Namespace, flag: str) -> bool:
    value = getattr(args, _dest(flag), None)
    return value is not None and value is not False  # --k 0 is given


def method_options(args: argparse.Namespace, method: str, strict: bool = True) -> dict:
    """Method keyword options from the method flags in ``args`` (``strict``: refuse flags the
    method does not use)."""
    from .registry import AUTO

    every = flag_uses()
    used = {f for uses in every.values() for u in uses if u.method == method for f in (u.when, u.unless) if f}
    opts: dict = {}
    for flag, uses in every.items():
        if not _given(args, flag):
            continue
        mine = [u for u in uses if u.method == method]
        for u in mine:
            if (u.when is None or _given(args, u.when)) and (u.unless is None or not _given(args, u.unless)):
                opts[u.field] = u.value if u.value is not None else getattr(args, _dest(flag))
        if strict and not mine and flag not in used:
            users = list(dict.fromkeys([u.method for u in uses] + [
                u.method for other in every.values() for u in other if flag in (u.when, u.unless)]))
            named = " and ".join([", ".join(users[:-1]), users[-1]] if len(users) > 1 else users)
            note = ", which chooses the method and its settings itself" if method == AUTO else ""
            raise SelfspecError(f"{flag} is only used by {named}, not --method {method}{note}")
    return opts
