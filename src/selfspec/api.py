"""The public surface: ``selfspec.load(...)`` returns a generator with ``generate``/``stream``
(:mod:`selfspec.generator`), its configuration chosen by ``auto`` where asked."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .autoselect.configure import configure
from .autoselect.routing import AutoGenerator, CompiledFallback
from .config import check_threads
from .errors import SelfspecError
from .generator import GenerationResult, SpeculativeGenerator, build, torch_threads
from .models.bundled import DEFAULT_MODEL
from .models.loading import LoadedModel, Runner, load_model
from .models.selftest import cached_tree_self_test, keep_int8_promise
from .notes import notes_on_stderr, show_progress
from .registry import AUTO, method_config

__all__ = ["AutoGenerator", "CompiledFallback", "GenerationResult", "SpeculativeGenerator", "build", "load",
           "torch_threads"]


def load(model: str | LoadedModel | Runner = DEFAULT_MODEL, method: str = AUTO, device: str | None = "cpu",
         dtype: str | torch.dtype = "float32", trust_remote_code: bool = False, self_test: bool = True,
         kernels: str | None = None, remeasure: bool = False, threads: int | None = None, measure: bool = True,
         progress: bool | None = None, batching: bool = False, **method_options: Any) -> SpeculativeGenerator:
    """Load a model and a decoding method.

    ``auto`` (the default for both ``method`` and ``kernels``, as in the CLI) chooses the
    configuration (method, verify kernels, draft precision) together, by decode tokens/s on a
    short calibration in this process, cached per model and machine (:mod:`selfspec.autoselect`).
    A method or kernels given fix that part of the choice; with both given nothing is measured.

    Args:
        model: bundled name, local HF directory, ``.gguf`` file, hub id, or an already loaded model
            (a :class:`~selfspec.models.runner.LoadedModel`, or a runner of one, e.g. another
            generator's ``target``): the new generator runs the same weights on runners of its
            own configuration, and the other generators over them are left as they are.
        method: one of ``selfspec.METHODS`` (e.g. ``"ar"``, ``"pld"``, ``"draft-model"``), or
            ``"auto"``: the fastest lossless configuration here; the generator's ``method`` then
            reads e.g. ``"auto→self-spec@stock, draft int8"``. ``auto`` takes only ``draft_model``.
        remeasure: calibrate again instead of using the cached choice (where anything is chosen).
        device: ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``auto``.
        dtype: ``float32`` (default; exact greedy equality), ``bfloat16`` or ``float16``.
        trust_remote_code: allow custom modelling code from a model repository (off by default).
        self_test: check at load time that tree verification equals sequential decoding.
        kernels: linear-layer backend, one of ``selfspec.KERNELS``: ``auto`` (default for a new
            load, or ``$SELFSPEC_KERNELS`` where set: the fp32 backend that decodes the method
            fastest here, chosen with it), ``stock`` (PyTorch's kernels), ``onednn`` (fp32,
            prepacked; CPU) or ``int8`` (quantised model, opt-in). None: a runner's own backend
            where ``model`` is a runner, else as for a new load.
        measure: False measures nothing and writes nothing: ``auto`` uses its cached choice, else the
            plain default (``ar``, with a note); methods size drafts from cached cost profiles, else
            fixed sizes; the self-test runs unless recorded, and is not recorded (CLI ``--no-measure``).
        threads: torch CPU threads to load, measure and generate with (restored after each call;
            None: torch's choice, usually one per core). On a machine busy with other work,
            ``threads=1`` can be several times faster.
        progress: show the long steps (conversion, calibration, compiling) as ``selfspec: ...`` lines
            on stderr while loading. None (default): when stderr is a terminal and nothing handles
            the ``selfspec`` logger, where the notes always go.
        batching: ``auto`` chooses among the configurations whose requests can share a batch's
            forwards (``generate_batch``, ``selfspec serve``): no draft head or draft model of their
            own, no compiled step. A method given is loaded as it is.
        **method_options: options of the method's config, e.g. ``draft_model="..."``, ``k=4``.
    """
    check_threads(threads)
    shown = notes_on_stderr() if show_progress(progress) else contextlib.nullcontext()
    with shown, torch_threads(threads):
        g = _load(model, method, device, dtype, trust_remote_code, self_test, kernels, remeasure, method_options,
                  measure, batching)
    g.threads = threads
    return g


def _load(model: str | LoadedModel | Runner, method: str, device: str | None, dtype: str | torch.dtype,
          trust_remote_code: bool, self_test: bool, kernels: str | None, remeasure: bool,
          method_options: dict, measure: bool = True, batching: bool = False) -> SpeculativeGenerator:
    """:func:`load` on the threads as they are."""
    from .kernels import KERNELS, default_kernels

    if method == AUTO:
        unknown = sorted(set(method_options) - {"draft_model"})
        if unknown:
            raise SelfspecError(f"method 'auto' has no option {unknown[0]!r}; it takes only draft_model (it chooses "
                                "a method and its settings itself; name a method to set its options)")
    else:
        method_config(method, method_options)
    if kernels is not None and kernels not in KERNELS:
        raise SelfspecError(f"unknown kernels '{kernels}'; choose one of: {', '.join(KERNELS)}")
    given = isinstance(model, (LoadedModel, Runner))
    if isinstance(model, Runner):
        kernels = model.backend if kernels is None else kernels
        base = model.base
    elif isinstance(model, LoadedModel):
        kernels, base = kernels or default_kernels(), model
    else:
        kernels = kernels or default_kernels()
        base = load_model(model, device, dtype, trust_remote_code).base
    if kernels == AUTO:
        return configure(base, method, method_options, trust_remote_code, remeasure, self_test, keep=given,
                         measure=measure, batching=batching)
    same = model if isinstance(model, Runner) and model.backend == kernels else None
    target = _checked(same if same is not None else base.runner(kernels), self_test, measure)
    if method == AUTO:
        return configure(base, method, method_options, trust_remote_code, remeasure, False, keep=given,
                         kernels=[target.backend], measure=measure, batching=batching)
    return build(target, method, method_options, trust_remote_code, measure=measure)


def _checked(target: Runner, self_test: bool, measure: bool = True) -> Runner:
    """``target`` after the load-time self-test (tree verification equals sequential decoding), or
    the runner to use instead where an int8 runner breaks its promise on this machine."""
    if not self_test:
        return target
    worst = cached_tree_self_test(target, save=measure)  # recorded per model files, backend, code and machine
    return keep_int8_promise(target, lambda m: worst)  # int8 promises bit-identical rows: checked, else stock
