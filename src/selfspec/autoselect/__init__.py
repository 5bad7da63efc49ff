"""``auto``: the fastest exact configuration for this model here, chosen end to end.

A configuration (:class:`Candidate`) is a method, its verify kernels (the lossless fp32 backends
that run here) and, where the method has that option, its draft precision (drafts need no exactness:
verification stays on the verify kernels). Methods come from the registry's specs
(:class:`~selfspec.drafters.spec.AutoCandidacy`); this module names none and never calls
``api.load``. The cross product is measured by greedy decode tokens/s on the shipped calibration
prompts, in the process that will decode, each on its backend's runner of the loaded model
(built once, never switched), by successive halving
(:data:`ROUNDS`): every candidate decodes one prompt (:data:`PRUNE_TOKENS` tokens), the fastest few
two more, interleaved, the best two the last, and the fastest over all it decoded wins
(:func:`select`). Not a proxy: T(1) + T(4) chose the slower kernels on an Intel AMX Xeon (the
default ran at 0.86x the best fixed configuration). Where the method is chosen, a candidate whose
ids differ from the reference's (``ar``) on the same kernels is disqualified. ``--method M`` leaves
only kernels to choose (no reference), ``--kernels X`` only methods, both nothing.

The choice is cached per model, machine and candidate list (a new head, skip config or fine-tune
means a new measurement); ``remeasure`` redoes it, a corrupt cache is measured again, and a choice
calibrated while the machine was busy is redone on a later start that finds it quiet. See
``docs/DESIGN.md``, "Choosing the configuration".
"""

from __future__ import annotations

from .calibration import (
    AUTO_PREFIX,
    BUDGET_S,
    BUSY_CUT,
    CACHE_FORMAT,
    CALIBRATION_PROMPTS,
    CALIBRATION_TOKENS,
    PRUNE_TOKENS,
    ROUNDS,
    WARMUP_TOKENS,
    Calibration,
    Candidate,
    Choice,
    Decoder,
    auto_label,
    calibration_prompts,
    candidates,
    config_label,
    fit_round,
    measure,
    select,
    usable_precisions,
)
from .choice import cache_key, cache_path, choose, machine_busy, read_cache

__all__ = ["AUTO_PREFIX", "BUDGET_S", "BUSY_CUT", "CACHE_FORMAT", "CALIBRATION_PROMPTS", "CALIBRATION_TOKENS",
           "PRUNE_TOKENS", "ROUNDS", "WARMUP_TOKENS", "Calibration", "Candidate", "Choice", "Decoder", "auto_label",
           "cache_key", "cache_path", "calibration_prompts", "candidates", "choose", "config_label", "fit_round",
           "machine_busy", "measure", "read_cache", "select", "usable_precisions"]
