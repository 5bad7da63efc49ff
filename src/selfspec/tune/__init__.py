"""Offline searches that write a method's configuration (``selfspec tune``)."""

from .self_spec import OBJECTIVES, TuneOptions, tune_self_spec

__all__ = ["OBJECTIVES", "TuneOptions", "tune_self_spec"]
