"""``--kernels auto`` where no decoding method is at hand (``selfspec tune``, ``profile``): the fastest
fp32 runner by the quick proxy of :mod:`selfspec.kernels.auto` (T(1) + T(4) at a 128-token cache,
interleaved, cached per model, dtype, device and machine). ``selfspec.load`` chooses kernels with
the method instead (:mod:`.configure`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

from torch import nn

from ..core.cost import profile_key, profile_path, read_cache, save_cache
from ..kernels.auto import ROUNDS, candidates, quick_cost
from ..models.runner import LoadedModel, Runner

log = logging.getLogger("selfspec.kernels")


def fastest_runner(base: LoadedModel, measure: bool = True) -> Runner:
    """The runner of ``base`` on the backend :func:`choose` picks (the others are dropped); the one
    backend it has where its fp32 weights were released."""
    if base.only is not None:
        return base.runner(base.only)
    kernels = choose(base.model, base.name, lambda k: base.runner(k).model, measure)
    base.keep_only(kernels)
    return base.runner(kernels)


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
