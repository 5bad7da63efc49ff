"""The public surface: ``selfspec.load(...)`` returns a generator with ``generate``/``stream``
(:mod:`selfspec.generator`), its configuration chosen by ``auto`` where asked."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import check_threads
from .errors import SelfspecError
from .generator import CompiledFallback, GenerationResult, SpeculativeGenerator, torch_threads
from .models.bundled import DEFAULT_MODEL
from .models.compiled_step import MIN_CAPACITY
from .models.loading import LoadedModel, load_model
from .models.selftest import cached_tree_self_test, keep_int8_promise
from .registry import AUTO, BASELINE, METHODS, BuildContext, compiled_blocks, method_config

if TYPE_CHECKING:
    from .autoselect import Candidate

__all__ = ["CompiledFallback", "GenerationResult", "SpeculativeGenerator", "build", "compiled_ready", "load",
           "torch_threads"]

log = logging.getLogger("selfspec.auto")


def load(model: str | LoadedModel = DEFAULT_MODEL, method: str = AUTO, device: str | None = "cpu",
         dtype: str | torch.dtype = "float32", trust_remote_code: bool = False, self_test: bool = True,
         kernels: str | None = None, remeasure: bool = False, threads: int | None = None,
         **method_options) -> SpeculativeGenerator:
    """Load a model and a decoding method.

    ``auto`` (the default for both ``method`` and ``kernels``, as in the CLI) chooses the
    configuration (method, verify kernels, draft precision) together, by decode tokens/s on a
    short calibration in this process, cached per model and machine (:mod:`selfspec.autoselect`).
    A method or kernels given fix that part of the choice; with both given nothing is measured.

    Args:
        model: bundled name, local HF directory, ``.gguf`` file, hub id, or an already loaded model.
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
            prepacked; CPU) or ``int8`` (quantised model, opt-in). None keeps a loaded model's
            current backend.
        threads: torch CPU threads to load, measure and generate with (restored after each call;
            None: torch's choice, usually one per core). On a machine busy with other work,
            ``threads=1`` can be several times faster.
        **method_options: options of the method's config, e.g. ``draft_model="..."``, ``k=4``.
    """
    check_threads(threads)
    with torch_threads(threads):
        g = _load(model, method, device, dtype, trust_remote_code, self_test, kernels, remeasure, method_options)
    g.threads = threads
    return g


def _load(model: str | LoadedModel, method: str, device: str | None, dtype: str | torch.dtype,
          trust_remote_code: bool, self_test: bool, kernels: str | None, remeasure: bool,
          method_options: dict) -> SpeculativeGenerator:
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
    if isinstance(model, LoadedModel):
        target = model
        kernels = target.backend if kernels is None else kernels
    else:
        kernels = kernels or default_kernels()
        target = load_model(model, device, dtype, trust_remote_code, kernels="stock" if kernels == AUTO else kernels)
    if kernels != AUTO and kernels != target.backend:
        target.use_kernels(kernels)
    if self_test:
        worst = cached_tree_self_test(target)  # recorded per model files, backend, code and machine
        keep_int8_promise(target, lambda m: worst)  # int8 promises bit-identical rows: checked, else stock
    if method == AUTO or kernels == AUTO:
        return _load_chosen(target, method, method_options, kernels, trust_remote_code, remeasure,
                            keep=isinstance(model, LoadedModel))
    return build(target, method, method_options, trust_remote_code)


def build(target: LoadedModel, method: str, options: dict, trust_remote_code: bool,
           sizes: tuple[int, ...] = (1,)) -> SpeculativeGenerator:
    """``method`` with ``options`` on ``target`` as it is now (its current kernels), through the
    registry. On the compiled backend, the steps of blocks of ``sizes`` compile (or load from the
    cache) now, not mid-request."""
    ctx = BuildContext(device=target.device, dtype=target.model.dtype, trust_remote_code=trust_remote_code,
                       kernels=target.backend)
    spec = METHODS[method]
    drafter = spec.build(target, method_config(method, options), ctx)
    if target.step is not None:
        target.step.warm_up(MIN_CAPACITY, sizes, drafter.needs_hidden)
    return SpeculativeGenerator(target, method, drafter, spec.lossless)


def compiled_ready(target: LoadedModel, methods: Sequence[str]) -> list[str]:
    """Those of ``methods`` whose compiled steps (every block size of
    :func:`~selfspec.registry.compiled_blocks`, on the default static cache, with or
    without hidden states) are saved on this machine, so that ``auto`` can time them on the
    ``compiled`` backend without compiling anything (``selfspec compile`` saves them). Switches
    ``target`` to the compiled backend (keeping its current layers) only where some step of this
    model could be saved; it is left on the backend it was on."""
    from .models import aot_step
    from .models.compiled_step import compile_cache_dir

    d = compile_cache_dir()
    if d is None or not aot_step.supported(target.device) or target.model.dtype != torch.float32:
        return []
    if not any((Path(d) / "aot").glob(f"step-1x{MIN_CAPACITY}-*.bin")):  # nothing compiled here yet: no switch
        return []
    before = target.backend
    target.use_kernels("compiled", keep=True)
    try:
        step = target.step
        assert step is not None
        return [m for m in methods
                if any(not step.missing(MIN_CAPACITY, compiled_blocks(m), hidden) for hidden in (False, True))]
    finally:
        target.use_kernels(before, keep=True)


def draft_steps_missing(target: LoadedModel, cands: Sequence[Candidate]) -> list[Candidate]:
    """Those of the ``compiled`` candidates ``cands`` whose drafter would compile a draft step of its
    own when built (:attr:`~selfspec.drafters.spec.MethodSpec.draft_step`: self-spec's int8 draft,
    about half a minute on SmolLM2), told without building them; ``target`` is switched to the
    compiled backend to tell, and left on the backend it was on."""
    need = [c for c in cands if c.kernels == "compiled" and METHODS[c.method].draft_step is not None]
    if not need:
        return []
    before = target.backend
    target.use_kernels("compiled", keep=True)
    try:
        return [c for c in need if METHODS[c.method].draft_step(target, method_config(c.method, c.options))]
    finally:
        target.use_kernels(before, keep=True)


def _auto_sizes(c: Candidate) -> tuple[int, ...]:
    """The compiled block sizes of a candidate of ``auto``: all it verifies on the compiled backend
    (saved here, or it would be no candidate), loaded before it is timed so no timed run loads one."""
    return compiled_blocks(c.method) if c.kernels == "compiled" else (1,)


def _load_chosen(target: LoadedModel, method: str, options: dict, kernels: str, trust_remote_code: bool,
                 remeasure: bool, keep: bool) -> SpeculativeGenerator:
    """``auto`` for the method, the kernels or both: the candidates (the registry's ``auto``
    candidates, or ``method`` alone, on every fp32 backend here or on ``kernels`` alone), the
    choice (cached, else calibrated with the kernels switched in place), and the chosen one built.
    Unless ``keep`` (a model the caller loaded, which other generators may share), the layers of
    the backends not chosen are freed."""
    from . import autoselect
    from .drafters.spec import AutoContext
    from .kernels.auto import candidates as fp32_kernels

    backends = fp32_kernels(target.model) if kernels == AUTO else [kernels]
    ctx = AutoContext(draft_model=options.get("draft_model") or None,  # precisions found (and noted) once
                      draft_precisions=autoselect.usable_precisions(target.device.type) if method == AUTO else ())

    def on(kernel_list: list[str]) -> list[autoselect.Candidate]:
        if method == AUTO:
            return autoselect.candidates(target, METHODS.values(), kernel_list, ctx)
        return [autoselect.Candidate(method, dict(options), k) for k in kernel_list]  # only kernels are chosen

    cands = on(backends)
    reference = BASELINE if method == AUTO else None  # a fixed method has nothing to be compared with
    if kernels == "compiled" or (kernels == AUTO and "stock" in backends):  # not where fp32 weights were released
        # the compiled step, for the methods whose steps are saved here: auto compiles nothing itself
        compiled = on(["compiled"])
        ready = compiled_ready(target, list(dict.fromkeys(c.method for c in compiled)))
        compiled = [c for c in compiled if c.method in ready]
        no_draft = draft_steps_missing(target, compiled)
        for c in no_draft:
            log.info(f"auto: {c.label} is left out: its draft step is not compiled on this machine (`selfspec "
                     "compile` compiles it once; auto then times it too)")
        cands = [c for c in cands if c.kernels != "compiled"] + [c for c in compiled if c not in no_draft]
        if not ready:
            if kernels == "compiled":
                raise SelfspecError("auto on the compiled kernels times only steps compiled ahead, and none are "
                                    "saved here for this model: run `selfspec compile` first (minutes, once per "
                                    "machine), or name a method, e.g. --method pld")
            log.info("auto: the compiled kernels are left out: their steps are not compiled on this machine "
                     "(`selfspec compile` compiles them once, in minutes; auto then times them too)")

    def make(c: autoselect.Candidate) -> SpeculativeGenerator:
        if target.backend != c.kernels:
            target.use_kernels(c.kernels, keep=True)  # in place: the other backends' layers stay for the next
        return build(target, c.method, c.options, trust_remote_code, _auto_sizes(c))

    choice = autoselect.choose(target, make, cands, reference, remeasure=remeasure)
    c = choice.candidate
    if len(backends) > 1 or target.backend != c.kernels:
        target.use_kernels(c.kernels, keep=keep)  # without keep: frees the layers of the backends not chosen
    g = build(target, c.method, c.options, trust_remote_code)  # later block sizes: saved, loaded when first met
    if method == AUTO:
        g.method = autoselect.auto_label(c)
    g.auto_choice = choice
    g.auto_table = choice.table
    measured = {**choice.pruned, **choice.table}
    alt = max((x for x in cands if x.kernels != "compiled" and x.label in measured), key=lambda x: measured[x.label],
              default=None)
    if c.kernels == "compiled" and alt is not None:

        def build_alt() -> SpeculativeGenerator:
            target.use_kernels(alt.kernels, keep=True)
            h = build(target, alt.method, alt.options, trust_remote_code)
            if method == AUTO:
                h.method = autoselect.auto_label(alt)
            return h

        g.fallback = CompiledFallback(_auto_sizes(c), alt.label, build_alt)
    return g
