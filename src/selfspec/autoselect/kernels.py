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

from ..core import store
from ..core.timing import interleaved
from ..kernels.auto import ROUNDS, candidates, quick_case
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
    """The backend with the lowest T(1) + T(4) (:func:`~selfspec.kernels.auto.quick_case`); stored per
    model and machine.
    ``runner_model(backend)``: the module tree of ``model``'s runner on that backend (built once
    by the caller; :meth:`~selfspec.models.runner.LoadedModel.runner`). ``measure`` off: the cached
    choice, else ``stock`` (nothing is timed or written)."""
    cands = candidates(model)
    if len(cands) == 1:
        return cands[0]
    key = store.key(store.Kind.KERNELS_CHOICE, model, model_name, "auto")
    cached = store.read(key, store.KernelsChoice)
    if cached is not None and cached.backend in cands:  # corrupt or unreadable: measured again, never trusted
        return cached.backend
    if not measure:
        log.info(f"kernels auto: nothing measured (measure off) and no cached choice: stock kernels for {model_name}")
        return "stock"
    log.info(f"timing fp32 kernels ({', '.join(cands)}) for {model_name} on this machine (once) ...")
    cases = {name: quick_case(runner_model(name)) for name in cands}  # each runner as it would run
    samples = interleaved({name: case for name, (case, _) in cases.items()}, ROUNDS,
                          device=next(model.parameters()).device, reset=lambda name: cases[name][1]())
    costs = {name: statistics.median(v) for name, v in samples.items()}
    choice = min(costs, key=costs.__getitem__)
    log.info(f"{choice} kernels are the fastest here ("
             + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in costs.items()) + " for T(1) + T(4))")
    # a read-only home: the per-user cache, else measured again next time (a note, not an error)
    store.write(key, store.KernelsChoice(choice, costs), "kernels choice")
    return choice
