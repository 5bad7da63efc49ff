"""``auto``, whole: the candidates (method, verify kernels, draft precision) for a loaded model, each
built on its backend's runner (built once, never switched), timed side by side (:mod:`.choice`),
the winner built and the runners not chosen dropped. The one place ``selfspec.load`` chooses;
whether a compiled step is saved is a question about files on disk, answered without compiling.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from ..drafters.spec import AutoContext
from ..errors import SelfspecError
from ..generator import SpeculativeGenerator, build, build_drafter
from ..models.compiled_step import MIN_CAPACITY
from ..models.runner import LoadedModel
from ..models.selftest import cached_tree_self_test
from ..registry import AUTO, BASELINE, METHODS, compiled_blocks, method_config
from .batches import BATCH_WIDTH, BatchDecoder
from .calibration import Candidate, auto_label, calibration_prompts, candidates, usable_precisions
from .choice import choose
from .routing import AutoGenerator, CompiledFallback

log = logging.getLogger("selfspec.auto")


def compiled_ready(base: LoadedModel, methods: Sequence[str]) -> list[str]:
    """Those of ``methods`` whose compiled steps (every block size of
    :func:`~selfspec.registry.compiled_blocks`, on the default static cache, with or
    without hidden states) are saved on this machine, so that ``auto`` can time them on the
    ``compiled`` backend without compiling anything (``selfspec compile`` saves them). Builds the
    compiled runner only where some step of this model could be saved."""
    from ..models import aot_step
    from ..models.compiled_step import compile_cache_dir

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
    need = [(c, step) for c in cands if c.kernels == "compiled" and (step := METHODS[c.method].draft_step) is not None]
    if not need:
        return []
    target = base.runner("compiled")
    return [c for c, step in need if step(target, method_config(c.method, c.options))]


def auto_sizes(c: Candidate) -> tuple[int, ...]:
    """The compiled block sizes of a candidate of ``auto``: all it verifies on the compiled backend
    (saved here, or it would be no candidate), loaded before it is timed so no timed run loads one."""
    return compiled_blocks(c.method) if c.kernels == "compiled" else (1,)


def for_batches(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates a server times: those whose requests can share a batch's packed forwards
    (what :meth:`~selfspec.generator.SpeculativeGenerator.batchable` asks of a generator: an eager
    backend, and a drafter that loads no weights of its own), and whose drafts run no forwards of
    their own (:attr:`~selfspec.drafters.spec.MethodSpec.draft_forwards`).

    Those draft forwards run in each request's thread, one request after another, while the packed
    forward waits for every one. On 2026-12-07 (2-core EPYC, AVX2, SmolLM2) ``self-spec@compact,
    draft as verify`` won one stream's calibration (26.0 tok/s against ``ar``'s 24.7) and batches
    of 4 short calibration prompts (54.0 against 48.6), then served 4 and 8 clients at 20.6 and 16.8
    tok/s, below its one client's 23.1: at 8 requests 2 s passed between packed forwards
    (``docs/results/serving-batching-avx2-1207-one-stream``)."""
    return [c for c in cands if c.kernels != "compiled" and not METHODS[c.method].draft_weights
            and not METHODS[c.method].draft_forwards]


def configure(base: LoadedModel, method: str, options: dict, trust_remote_code: bool, remeasure: bool,
              self_test: bool, keep: bool, kernels: list[str] | None = None,
              measure: bool = True, batching: bool = False) -> SpeculativeGenerator:
    """``auto`` for the method, the kernels or both: the candidates (the registry's ``auto``
    candidates, or ``method`` alone, on every fp32 backend here or on ``kernels`` alone), the
    choice (cached, else calibrated on each candidate's own runner, side by side), and the chosen
    one built. Unless ``keep`` (a model the caller loaded, which other generators may share), the
    runners not chosen are dropped (their weight copies freed). ``batching``: only candidates
    whose requests can share a batch (:func:`for_batches`; a server's), where any remain."""
    from ..kernels.auto import batch_candidates
    from ..kernels.auto import candidates as fp32_kernels

    served = batching and method == AUTO  # a server's auto: row-invariant backends, timed on batches
    if kernels is None:
        kernels = ((batch_candidates if served else fp32_kernels)(base.model) if base.only is None
                   else [base.only])
        if "stock" in kernels:  # not where fp32 weights were released
            kernels = [*kernels, "compiled"]
    ctx = AutoContext(draft_model=options.get("draft_model") or None,  # precisions found (and noted) once
                      draft_precisions=usable_precisions(base.device.type) if method == AUTO else ())
    eager = [k for k in kernels if k != "compiled"]
    asked = base.runner(eager[0] if eager else "stock")  # what the candidates' artefacts are looked up for
    if self_test:
        cached_tree_self_test(asked, save=measure)  # once, as every fp32 runner's (int8: checked by the caller)

    def on(kernel_list: list[str]) -> list[Candidate]:
        if method == AUTO:
            return candidates(asked, METHODS.values(), kernel_list, ctx)
        return [Candidate(method, dict(options), k) for k in kernel_list]  # only kernels are chosen

    cands = on(eager)
    if "compact" in eager:  # its kernel's one-off build (a compiler process) before the clock starts:
        from ..kernels.compact import load_ops  # timed, it would spend the budget and read as a busy machine

        load_ops()
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

    if served:  # a server: a configuration that decodes requests one at a time would
        # hold every other client back, however fast its one stream (eagle2 won a solo calibration here by 1%)
        cands = for_batches(cands) or cands

    width = BATCH_WIDTH if served else 1  # a server's auto times batches (.batches)
    prompts = calibration_prompts()

    def make(c: Candidate) -> SpeculativeGenerator | BatchDecoder:
        g = build(base.runner(c.kernels), c.method, c.options, trust_remote_code, auto_sizes(c))
        return BatchDecoder(g, prompts, width) if width > 1 else g

    choice = choose(asked, make, cands, reference, remeasure=remeasure, measure=measure, prompts=prompts, width=width)
    c = choice.candidate
    target = base.runner(c.kernels)
    measured = {**choice.pruned, **choice.table}
    alt = max((x for x in cands if x.kernels != "compiled" and x.label in measured), key=lambda x: measured[x.label],
              default=None)
    fallback = None
    if c.kernels == "compiled" and alt is not None:

        def build_alt() -> SpeculativeGenerator:
            h = build(base.runner(alt.kernels), alt.method, alt.options, trust_remote_code, measure=measure)
            if method == AUTO:
                h.method = auto_label(alt)
            return h

        fallback = CompiledFallback(auto_sizes(c), alt.label, build_alt)
    elif not keep:
        base.keep_only(target.backend)  # the runners not chosen: their weight copies freed
    drafter, lossless = build_drafter(target, c.method, c.options, trust_remote_code, measure=measure)  # later
    # blocks: loaded when met
    return AutoGenerator(target, auto_label(c) if method == AUTO else c.method, drafter, lossless, choice, fallback,
                         measure=measure, recipe=(c.method, dict(c.options), trust_remote_code))
