"""Trained draft heads (EAGLE / HASS) and where they are found."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..paths import model_key, selfspec_home

# The scripts that train the heads shipped for the default model (what an error names when none is found).
HEAD_RECIPES = {"eagle2": "scripts/train_eagle2.sh", "hass": "scripts/train_hass_long.sh"}


def default_head_dir(model_name: str, method: str) -> Path:
    """``$SELFSPEC_HOME/heads/<model>-<method>``: where ``scripts/train_eagle2.sh`` puts its head and
    where a head that ``--method eagle2`` / ``hass`` use when no ``head`` is given lives (before the
    shipped one)."""
    return selfspec_home() / "heads" / f"{model_key(model_name)}-{method}"


def shipped_head_dir(model_name: str, method: str) -> Path | None:
    """The head shipped in the package (``selfspec/data/heads/<model>-<method>``, fp16), or None."""
    p = resources.files("selfspec") / "data" / "heads" / f"{model_key(model_name)}-{method}"
    return Path(str(p)) if p.is_dir() else None


def find_head_dir(model_name: str, method: str) -> Path | None:
    """The head ``eagle2`` / ``hass`` use by default: the user's trained one, else the shipped one."""
    user = default_head_dir(model_name, method)
    if (user / "selfspec_head.json").is_file():
        return user
    return shipped_head_dir(model_name, method)
