"""``--kernels auto`` where no decoding method is at hand: the fastest fp32 backend by a proxy.

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
import statistics
from collections.abc import Callable

from torch import nn

from ..core.cost import measure, profile_key, profile_path, read_cache, save_cache
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


def choose(model: nn.Module, model_name: str, runner_model: Callable[[str], nn.Module], measure: bool = True) -> str:
    """The backend with the lowest :func:`quick_cost`; cached per model and machine.
    ``runner_model(backend)``: the module tree of ``model``'s runner on that backend (built once
    by the caller; :meth:`~selfspec.models.runner.LoadedModel.runner`). ``measure`` off: the cached
    choice, else ``stock`` (nothing is timed or written)."""
    cands = candidates(model)
    if len(cands) == 1:
        return cands[0]
    choice = read_cache(profile_path(profile_key(model, model_name, "auto-choice")), lambda d: d["backend"])
    if isinstance(choice, str) and choice in cands:  # corrupt or unreadable: measured again, never trusted
        return choice
    if not measure:
        log.info(f"kernels auto: nothing measured (measure off) and no cached choice: stock kernels for {model_name}")
        return "stock"
    log.info(f"timing fp32 kernels ({', '.join(cands)}) for {model_name} on this machine (once) ...")
    samples: dict[str, list[float]] = {name: [] for name in cands}
    for _ in range(ROUNDS):  # interleaved, so a change of machine load hits every candidate alike
        for name in cands:  # each candidate as it would run: its layers and its attention function
            samples[name].append(quick_cost(runner_model(name), model_name))
    costs = {name: statistics.median(v) for name, v in samples.items()}
    choice = min(costs, key=costs.get)
    log.info(f"{choice} kernels are the fastest here ("
             + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in costs.items()) + " for T(1) + T(4))")
    # a read-only home: the per-user cache, else measured again next time (a note, not an error)
    save_cache(profile_key(model, model_name, "auto-choice"), {"backend": choice, "seconds": costs}, "kernels choice")
    return choice
