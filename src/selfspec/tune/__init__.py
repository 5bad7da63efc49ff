"""Offline searches that write a method's configuration (``selfspec tune``)."""

from ..drafters.self_spec import SPEC as _SELF_SPEC
from .self_spec import OBJECTIVES, TuneOptions, tune_self_spec

# method -> its search (``selfspec tune --method``; the first is the default) and what it tunes
TUNERS = {_SELF_SPEC.name: tune_self_spec}
TUNES = {_SELF_SPEC.name: "which sub-layers the draft skips"}

__all__ = ["OBJECTIVES", "TUNERS", "TUNES", "TuneOptions", "tune_self_spec"]
