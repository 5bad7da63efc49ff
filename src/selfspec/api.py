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
from .models.loading import LoadedModel, Runner, load_model
from .models.selftest import cached_tree_self_test, keep_int8_promise
from .registry import AUTO, BASELINE, METHODS, BuildContext, compiled_blocks, method_config

if TYPE_CHECKING:
    from .autoselect import Candidate

__all__ = ["CompiledFallback", "GenerationResult", "SpeculativeGenerator", "build", "compiled_ready", "load",
           "torch_threads"]

log = logging.getLogger("selfspec.auto")


def load(model: str | LoadedModel | Runner = DEFAULT_MODEL, method: str = AUTO, device: str | None = "cpu",
         dtype: str | torch.dtype = "float32", trust_remote_code: bool = False, self_test: bool = True,
         kernels: str | None = None, remeasure: bool = False, threads: int | None = None, measure: bool = True,
         **method_options) -> SpeculativeGenerator:
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
        **method_options: options of the method's config, e.g. ``draft_model="..."``, ``k=4``.
    """
    check_threads(threads)
    with torch_threads(threads):
        g = _load(model, method, device, dtype, trust_remote_code, self_test, kernels, remeasure, method_options,
                  measure)
    g.threads = threads
    return g


def _load(model: str | LoadedModel | Runner, method: str, device: str | None, dtype: str | torch.dtype,
          trust_remote_code: bool, self_test: bool, kernels: str | None, remeasure: bool,
          method_options: dict, measure: bool = True) -> SpeculativeGenerator:
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
        return _load_chosen(base, method, method_options, trust_remote_code, remeasure, self_test, keep=given,
                            measure=measure)
    same = isinstance(model, Runner) and model.backend == kernels
    target = _checked(model if same else base.runner(kernels), self_test, measure)
    if method == AUTO:
        return _load_chosen(base, method, method_options, trust_remote_code, remeasure, False, keep=given,
                            kernels=[target.backend], measure=measure)
    return build(target, method, method_options, trust_remote_code, measure=measure)


def _checked(target: Runner, self_test: bool, measure: bool = True) -> Runner:
    """``target`` after the load-time self-test (tree verification equals sequential decoding), or
    the runner to use instead where an int8 runner breaks its promise on this machine."""
    if not self_test:
        return target
    worst = cached_tree_self_test(target, save=measure)  # recorded per model files, backend, code and machine
    return keep_int8_promise(target, lambda m: worst)  # int8 promises bit-identical rows: checked, else stock


def build(target: Runner, method: str, options: dict, trust_remote_code: bool,
          sizes: tuple[int, ...] = (1,), measure: bool = True) -> SpeculativeGenerator:
    """``method`` with ``options`` verified on runner ``target``, through the registry. On the
    compiled backend, the steps of blocks of ``sizes`` compile (or load from the cache) now, not
    mid-request. ``measure`` off: nothing is timed or written (cached measurements, else fixed sizes)."""
    ctx = BuildContext(device=target.device, dtype=target.model.dtype, trust_remote_code=trust_remote_code,
                       kernels=target.backend, measure=measure)
    spec = METHODS[method]
    drafter = spec.build(target, method_config(method, options), ctx)
    if target.step is not None:
        target.step.warm_up(MIN_CAPACITY, sizes, drafter.needs_hidden)
    g = SpeculativeGenerator(target, method, drafter, spec.lossless)
    g.measure = measure
    return g


def compiled_ready(base: LoadedModel, methods: Sequence[str]) -> list[str]:
    """Those of ``methods`` whose compiled steps (every block size of
    :func:`~selfspec.registry.compiled_blocks`, on the default static cache, with or
    without hidden states) are saved on this machine, so that ``auto`` can time them on the
    ``compiled`` backend without compiling anything (``selfspec compile`` saves them). Builds the
    compiled runner only where some step of this model could be saved."""
    from .models import aot_step
    from .models.compiled_step import compile_cache_dir

    d = compile_cache_dir()
    if d is None or not aot_step.supported(base.device) or base.model.dtype != torch.float32:
        return []
    if not any((Path(d) / "aot").glob(f"step-1x{MIN_CAPACITY}-*.bin")):  # nothing compiled here yet
        return []
    step = base.runner("compiled").step
    assert step is not None
    return [m for m in methods
            if any(not step.missing(MIN_CAPACITY, compiled_blocks(m), hidden) for hidden in (False, True))]


def draft_steps_missing(base: LoadedModel, cands: Sequence[Candidate]) -> list[Candidate]:
    """Those of the ``compiled`` candidates ``cands`` whose drafter would compile a draft step of its
    own when built (:attr:`~selfspec.drafters.spec.MethodSpec.draft_step`: self-spec's int8 draft,
    about half a minute on SmolLM2), told from the files on disk without building their drafters."""
    need = [c for c in cands if c.kernels == "compiled" and METHODS[c.method].draft_step is not None]
    if not need:
        return []
    target = base.runner("compiled")
    return [c for c in need if METHODS[c.method].draft_step(target, method_config(c.method, c.options))]


def _auto_sizes(c: Candidate) -> tuple[int, ...]:
    """The compiled block sizes of a candidate of ``auto``: all it verifies on the compiled backend
    (saved here, or it would be no candidate), loaded before it is timed so no timed run loads one."""
    return compiled_blocks(c.method) if c.kernels == "compiled" else (1,)


def _load_chosen(base: LoadedModel, method: str, options: dict, trust_remote_code: bool, remeasure: bool,
                 self_test: bool, keep: bool, kernels: list[str] | None = None,
                 measure: bool = True) -> SpeculativeGenerator:
    """``auto`` for the method, the kernels or both: the candidates (the registry's ``auto``
    candidates, or ``method`` alone, on every fp32 backend here or on ``kernels`` alone), the
    choice (cached, else calibrated on each candidate's own runner, side by side), and the chosen
    one built. Unless ``keep`` (a model the caller loaded, which other generators may share), the
    runners not chosen are dropped (their weight copies freed)."""
    from . import autoselect
    from .drafters.spec import AutoContext
    from .kernels.auto import candidates as fp32_kernels

    if kernels is None:
        kernels = fp32_kernels(base.model) if base.only is None else [base.only]
        if "stock" in kernels:  # not where fp32 weights were released
            kernels = [*kernels, "compiled"]
    ctx = AutoContext(draft_model=options.get("draft_model") or None,  # precisions found (and noted) once
                      draft_precisions=autoselect.usable_precisions(base.device.type) if method == AUTO else ())
    eager = [k for k in kernels if k != "compiled"]
    asked = base.runner(eager[0] if eager else "stock")  # what the candidates' artefacts are looked up for
    if self_test:
        cached_tree_self_test(asked, save=measure)  # once, as every fp32 runner's (int8: checked by the caller)

    def on(kernel_list: list[str]) -> list[autoselect.Candidate]:
        if method == AUTO:
            return autoselect.candidates(asked, METHODS.values(), kernel_list, ctx)
        return [autoselect.Candidate(method, dict(options), k) for k in kernel_list]  # only kernels are chosen

    cands = on(eager)
    reference = BASELINE if method == AUTO else None  # a fixed method has nothing to be compared with
    if "compiled" in kernels:  # the compiled step, for the methods whose steps are saved here: auto compiles nothing
        compiled = on(["compiled"])
        ready = compiled_ready(base, list(dict.fromkeys(c.method for c in compiled)))
        compiled = [c for c in compiled if c.method in ready]
        no_draft = draft_steps_missing(base, compiled)
        for c in no_draft:
            log.info(f"auto: {c.label} is left out: its draft step is not compiled on this machine (`selfspec "
                     "compile` compiles it once; auto then times it too)")
        cands += [c for c in compiled if c not in no_draft]
        if not ready:
            if kernels == ["compiled"]:
                raise SelfspecError("auto on the compiled kernels times only steps compiled ahead, and none are "
                                    "saved here for this model: run `selfspec compile` first (minutes, once per "
                                    "machine), or name a method, e.g. --method pld")
            log.info("auto: the compiled kernels are left out: their steps are not compiled on this machine "
                     "(`selfspec compile` compiles them once, in minutes; auto then times them too)")

    def make(c: autoselect.Candidate) -> SpeculativeGenerator:
        return build(base.runner(c.kernels), c.method, c.options, trust_remote_code, _auto_sizes(c))

    choice = autoselect.choose(asked, make, cands, reference, remeasure=remeasure, measure=measure)
    c = choice.candidate
    target = base.runner(c.kernels)
    g = build(target, c.method, c.options, trust_remote_code, measure=measure)  # later blocks: loaded when met
    if method == AUTO:
        g.method = autoselect.auto_label(c)
    g.auto_choice = choice
    g.auto_table = choice.table
    measured = {**choice.pruned, **choice.table}
    alt = max((x for x in cands if x.kernels != "compiled" and x.label in measured), key=lambda x: measured[x.label],
              default=None)
    if c.kernels == "compiled" and alt is not None:
        fallback = alt

        def build_alt() -> SpeculativeGenerator:
            h = build(base.runner(fallback.kernels), fallback.method, fallback.options, trust_remote_code,
                      measure=measure)
            if method == AUTO:
                h.method = autoselect.auto_label(fallback)
            return h

        g.fallback = CompiledFallback(_auto_sizes(c), alt.label, build_alt)
    elif not keep:
        base.keep_only(target.backend)  # the runners not chosen: their weight copies freed
    return g
