"""What ``--kernels auto`` chooses from where no decoding method is at hand, and the proxy it is
timed by (the choice itself: :mod:`selfspec.autoselect.kernels`).

``selfspec.load`` does not use this: it chooses kernels together with the method by decode
tokens/s (:mod:`selfspec.autoselect`), because the proxy below was wrong on an Intel AMX Xeon
(oneDNN won T(1) + T(4) while stock kernels decoded faster). What remains here serves the commands
that load a model without a method (``selfspec tune``, ``profile``):

Quick measurement (``core.cost.measure`` of q = 1 and 4 only, 128-token cache, the candidates
interleaved over 3 rounds), cached next to the cost profiles so it happens once per model,
dtype, device and machine. Score = median of T(1) + T(4): one decoding step plus one typical
verify step. A corrupt or unreadable cache is measured again, never trusted.
"""

from __future__ import annotations

import logging

from torch import nn

from ..core.cost import measure, profile_key
from .onednn import available as onednn_available

log = logging.getLogger("selfspec.kernels")

ROUNDS = 3


def candidates(model: nn.Module) -> list[str]:
    """The fp32 (lossless) backends that can run this model here."""
    p = next(model.parameters())
    out = ["stock"]
    if onednn_available(p.device, p.dtype) is None:
        out.append("onednn")
    return out


def quick_cost(model: nn.Module, model_name: str) -> float:
    """Median T(1) + median T(4) in seconds, after a 128-token prefix."""
    prof = measure(model, profile_key(model, model_name, "auto-quick"), qs=(1, 4), context=128, reps=3)
    return sum(prof.seconds)
