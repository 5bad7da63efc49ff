"""Trained draft heads (EAGLE / HASS) and where they are found."""

from __future__ import annotations

from pathlib import Path

from ..drafters.skip_config import model_key
from ..models.bundled import selfspec_home


def default_head_dir(model_name: str, method: str) -> Path:
    """``$SELFSPEC_HOME/heads/<model>-<method>``: where ``scripts/train_hass.sh`` puts the head
    that ``--method eagle2`` / ``hass`` use when no ``head`` is given."""
    return selfspec_home() / "heads" / f"{model_key(model_name)}-{method}"
