"""``self-spec``: Draft & Verify self-speculative decoding (layer skipping).

The draft is the target itself with some attention and MLP sub-layers skipped
(:mod:`selfspec.models.skipping`); no extra weights, no training. Each step:

1. Draft one token at a time from the pending token with the skipped model, on top of the
   committed cache. Non-skipped attention layers write their draft KV into the cache rows after
   the committed prefix (a pointer move in the preallocated cache); skipped layers write nothing.
   After drafting every layer is truncated back to the committed length, so the committed cache
   is never disturbed and verification recomputes all rows with the full model.
2. Stop drafting by one of two rules (``draft_exit``):
   - ``gamma``: the paper's adaptive draft exit: keep the token, then stop when its confidence
     is below gamma; gamma follows the acceptance rate (:class:`GammaExit`); at most K drafts.
   - ``cost``: the cost-aware budget of :mod:`selfspec.drafters.budget`: draft length from the
     measured verify cost profile, the measured draft cost and the acceptance seen so far; stop
     when the product of calibrated confidences (the chance, learned from verification, that a
     draft of that confidence is accepted) falls below ``min_confidence``; verify the best prefix.
   With ``auto_k`` both back off to plain decoding (no draft, occasional probes) when the
   measured acceptance and costs say drafting does not pay.
3. Verification is the ordinary full-model verify of the decode loop: greedy ids are those of
   ``ar``; sampled drafts carry the draft's warped q rows, so the chain rule is lossless.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..core import kv_cache
from ..core.acceptance import Verdict
from ..core.sampling import sample
from ..core.tree import DraftTree
from ..decoding.protocol import Budget, DrafterBase, Proposal, Sizer
from ..decoding.state import DecodeState, VerifyOutput
from ..errors import SelfspecError
from ..kernels.int8 import layer_classes as int8_layer_classes
from ..kernels.switch import DRAFT_KERNELS, layout_fits
from ..models.compiled_step import MIN_CAPACITY, compile_cache_dir, step_shapes
from ..models.runner import Runner
from ..models.skipping import SkipSet, skipped
from .budget import ChainBudget, ChainDraft, DraftRule, GammaExit
from .skip_config import GammaSettings, find
from .skip_draft import cached_draft_ratio, draft_forward
from .spec import AutoCandidacy, AutoContext, BuildContext, MethodSpec, chain_budget, check_numbers, need, option
from .vocab import DRAFT_VOCAB_HELP, DraftLMHead

DRAFT_EXITS = ("cost", "gamma")


@dataclass(frozen=True)
class SelfSpecConfig:
    """Options of ``self-spec`` (each field's help is in its metadata)."""

    skip_config: str = option("", "skip config JSON; empty = the tuned one for the model (yours from selfspec tune, "
                                  "else the one shipped with selfspec)", flag="--skip-config")
    skip_attention: tuple[int, ...] | None = option(None, "explicit attention sub-layers to skip (overrides any "
                                                          "skip config); a sequence, one index or text like 3+7")
    skip_mlp: tuple[int, ...] | None = option(None, "explicit MLP sub-layers to skip (with skip_attention)")
    draft_exit: str = option("cost", "stop drafting by the measured cost budget (cost) or the paper's adaptive "
                                     "confidence threshold gamma (gamma)", flag="--draft-exit", choices=DRAFT_EXITS)
    k: int | None = option(None, "the longest draft (the paper's K; default: the skip config's max_draft, 12); "
                                 "every draft when auto_k is off (--fixed-k) and draft_exit is cost", flag="--k")
    auto_k: bool = option(True, "back off to plain decoding when drafting does not pay (measured cost profile), "
                                "and with the cost exit size each draft from it", flag="--fixed-k", value=False)
    min_confidence: float = option(0.3, "cost exit: stop once the estimated chance that every draft is accepted "
                                        "(the product of calibrated draft confidences) falls below this")
    gamma0: float | None = option(None, "override the skip config's initial gamma (gamma exit)")
    alpha: float | None = option(None, "override the skip config's target acceptance alpha (gamma exit)")
    draft_vocab: int = option(-1, DRAFT_VOCAB_HELP, flag="--draft-vocab")
    draft_kernels: str = option("config", "kernels of the draft passes: int8 = a quantised copy of the model's own "
                                          "weights (+25% memory), bf16 = a bf16 copy (+50%; pays where the CPU has "
                                          "avx512_bf16 or AMX); verification stays on the model's kernels, so "
                                          "output is unchanged; same = the verify backend's, config = the skip "
                                          "config's (else same)",
                                flag="--draft-kernels", choices=("config", *DRAFT_KERNELS))

    def __post_init__(self) -> None:
        check_numbers(self, "self-spec")
        need(self, "self-spec", "draft_exit", self.draft_exit in DRAFT_EXITS, f"one of {', '.join(DRAFT_EXITS)}")
        need(self, "self-spec", "k", self.k is None or self.k >= 1, ">= 1")
        need(self, "self-spec", "min_confidence", 0.0 <= self.min_confidence < 1.0, "in [0, 1)")
        need(self, "self-spec", "draft_vocab", self.draft_vocab >= -1, ">= -1")
        need(self, "self-spec", "draft_kernels", self.draft_kernels in ("config", *DRAFT_KERNELS),
             f"one of config, {', '.join(DRAFT_KERNELS)}")


class SelfSpecDrafter(DrafterBase):
    name = "self-spec"
    lossless = True
    needs_hidden = False
    request_state = ("sizer",)  # what adapts across requests (LearnedState.snapshot / restore)
    sizer: Sizer | None  # the Drafter protocol's member, set in __init__

    def __init__(self, model: torch.nn.Module, skip: SkipSet, budget: ChainBudget, draft_exit: str = "cost",
                 gamma: GammaSettings | None = None, auto_k: bool = True, min_confidence: float = 0.3,
                 source: str = "explicit", lm_head: DraftLMHead | None = None,
                 layers: Runner | None = None) -> None:
        """
        Args:
            model: the verify runner's module tree (left as it is); the draft is a module tree of
                its own over the same weights, built here once: ``skip`` bypassed, on ``layers``.
            skip: the sub-layers the draft skips.
            budget: cost-aware chain budget (its ``k`` is the longest draft).
            draft_exit: ``cost`` or ``gamma`` (see the module docstring).
            gamma: settings of the ``gamma`` exit.
            auto_k: let the budget back off to no drafting (and, with ``cost``, size drafts).
            min_confidence: ``cost`` exit threshold on the product of confidences.
            source: where the skip set came from (a skip config path or ``explicit``).
            lm_head: a reduced draft LM head (None: the model's own).
            layers: the draft runner on other kernels (int8 weights;
                :meth:`~selfspec.models.runner.LoadedModel.draft_runner`), or None. Where it has a
                step (an int8 draft of the whole model with its own LM head beside the ``compiled``
                runner, :func:`draft_parts`), the draft passes run through it; else eagerly.
        """
        self.skip = skip
        self.layers = layers
        self.draft_model = skipped(layers.model if layers is not None else model, skip)  # [T] ids -> logits
        self.source = source
        self.draft_exit = draft_exit
        # the step rule over the budget and the gamma exit; fed by the controller
        self.sizer = DraftRule(budget, GammaExit(gamma or GammaSettings()), draft_exit, auto_k, min_confidence)
        self.device = next(model.parameters()).device
        self.lm_head = lm_head
        self.draft_step = layers.step if layers is not None else None  # compiled one-token draft step, or None

    def warm_up(self, capacity: int) -> float:
        """Compile (or load the saved) draft step for a ``capacity``-position cache now, not
        mid-request; seconds it took (0 without a draft step)."""
        if self.draft_step is None:
            return 0.0
        return self.draft_step.warm_up(capacity, (1,), False)

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        pass  # the controller starts the sizer's prompt (DraftRule.new_prompt)

    def propose(self, state: DecodeState, budget: Budget[DraftRule, ChainDraft] | None) -> Proposal:
        assert budget is not None  # the controller's: this drafter has a sizer
        rule = budget.sizer
        k = rule.max_draft(state.draft_room)
        if k == 0:
            return Proposal(DraftTree.chain([state.pending]))
        base = len(state.ids) - 1  # the committed cache (not read from a static cache's device counter)
        det = state.deterministic  # greedy, or coupled: the same Gumbel noise as the target's
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        confidences: list[float] = []
        x = state.pending
        rule.start()
        full = self.lm_head.full if self.lm_head is not None else (lambda v: v)
        try:
            for i in range(k):
                if self.draft_step is not None:  # compiled, on the target's static cache after the prefix
                    logits = self.draft_step.forward(state.cache, torch.tensor([x]), torch.tensor([base + i]), None,
                                                     False, base=base + i).logits[-1]
                else:
                    logits = full(draft_forward(self.draft_model, state.cache, [x], base + i, lm_head=self.lm_head)[-1])
                if det:
                    probs = state.scores(logits, state.draft_index(i + 1)).softmax(-1)
                    x = int(probs.argmax())
                    conf = float(probs[x])
                else:
                    q = state.warper.probs(logits)
                    x = sample(q, state.generator)
                    qs.append(q)  # the gamma exit reads the unwarped probability, the cost exit q's
                    conf = float(logits.softmax(-1)[x]) if self.draft_exit == "gamma" else float(q[x])
                tokens.append(x)
                confidences.append(conf)
                if rule.stop_after(conf):
                    break
        finally:
            kv_cache.truncate(state.cache, base)  # draft KV never reaches the committed cache
        made = ChainDraft(len(tokens), tuple(confidences))  # what the rule learns the draft's cost from
        keep = rule.verify_count(confidences)
        tokens, qs = tokens[:keep], qs[:keep]
        probs_rows = torch.stack([torch.zeros_like(qs[0]), *qs]) if qs and tokens else None
        budget.made = made
        return Proposal(DraftTree.chain([state.pending, *tokens], probs_rows))

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        pass  # the draft KV was truncated in propose (the controller feeds the sizer)


def _layers(value) -> tuple[int, ...]:
    """Layer indices from a sequence, one int, or text like ``"3+7+9"`` (bench entries)."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    try:
        if isinstance(value, str):
            return tuple(int(v) for v in value.replace("+", " ").split())
        return tuple(int(v) for v in value)
    except (TypeError, ValueError) as e:
        raise SelfspecError(f"self-spec layer indices must be integers, not {value!r}") from e


def resolve_skip(target, cfg: SelfSpecConfig
                 ) -> tuple[SkipSet, GammaSettings, str, tuple[float, float] | None, int, str]:
    """The skip set, gamma settings, source, measured priors (acceptance, draft cost / T(1)),
    draft vocabulary size and draft kernels of ``self-spec``: explicit sets (no priors, full
    vocabulary, the verify kernels unless named), else a skip config's."""
    from ..models.skipping import decoder_layers

    num_layers = len(decoder_layers(target.model))
    if cfg.skip_attention is not None or cfg.skip_mlp is not None:
        skip = SkipSet.of(_layers(cfg.skip_attention), _layers(cfg.skip_mlp))
        gamma, source, priors, vocab, kernels = GammaSettings(), "explicit", None, 0, "same"
    else:
        found = find(target.name, target.model, cfg.skip_config)
        if found is None:
            raise SelfspecError(
                f"no skip config for model '{target.name}': tune one with `selfspec tune {target.name} --method "
                "self-spec`, or pass --skip-config PATH (API: skip_attention=..., skip_mlp=...)")
        sc, source = found
        skip, gamma, priors = sc.skip, sc.gamma, sc.priors()
        vocab, kernels = sc.draft_vocab, sc.draft_kernels
    skip.check(num_layers)
    over: dict[str, Any] = {k: v for k, v in (("gamma0", cfg.gamma0), ("alpha", cfg.alpha)) if v is not None}
    if cfg.k is not None:
        over["max_draft"] = cfg.k
    vocab = vocab if cfg.draft_vocab == -1 else cfg.draft_vocab
    kernels = kernels if cfg.draft_kernels == "config" else cfg.draft_kernels
    return skip, dataclasses.replace(gamma, **over), source, priors, vocab, kernels


def draft_parts(target, vocab_size: int, kernels: str, skip: SkipSet | None = None
                ) -> tuple[DraftLMHead | None, Runner | None]:
    """The draft LM head over a reduced vocabulary (None: the model's own) and the draft runner on
    other kernels (None: the verify runner's; also when the runner itself is int8), shared with
    every drafter of the same kind over the loaded model
    (:meth:`~selfspec.models.runner.LoadedModel.draft_runner`).
    On the ``compiled`` backend (CPU) an int8 draft of the whole model (nothing skipped) with its own
    LM head gets the draft runner with the few-row layout and its own one-token compiled step,
    saved and loaded like the verify steps (its file's name differs by the int8 layer classes)."""
    from ..models.draft_vocab import draft_vocab_for

    kernels = "same" if kernels == target.backend else kernels
    vocab = draft_vocab_for(target, vocab_size)
    head_backend = kernels if kernels != "same" else target.backend
    lm_head = DraftLMHead(target.model.get_output_embeddings(), vocab, head_backend) if vocab is not None else None
    if kernels == "same":
        return lm_head, None
    layout = _draft_steps(target, skip or SkipSet(), lm_head is None, kernels)
    return lm_head, target.base.draft_runner(target, kernels, layout)


def _draft_steps(target, skip: SkipSet, own_head: bool, kernels: str) -> bool:
    """Whether the draft runs through a compiled step of its own (its draft runner with the few-row
    layout, :func:`draft_parts`)."""
    return (target.step is not None and kernels == "int8" and own_head and not skip.size
            and target.device.type == "cpu" and layout_fits(target.model))


def draft_step_missing(target, cfg: SelfSpecConfig) -> bool:
    """Whether a drafter built with ``cfg`` on ``target`` (the compiled runner) would compile a
    draft step of its own now: a question about files on disk, told without building the draft's
    layers (the int8 copy takes seconds), from the classes they would have."""
    from ..models import aot_step
    from ..models.draft_vocab import draft_vocab_for

    skip, _, _, _, vocab, kernels = resolve_skip(target, cfg)
    kernels = "same" if kernels == target.backend else kernels
    if not _draft_steps(target, skip, draft_vocab_for(target, vocab) is None, kernels) or not target.step.compile:
        return False
    d = compile_cache_dir()
    shapes = step_shapes(MIN_CAPACITY, (1,), False)
    if d is None or not aot_step.supported(target.device):
        return True
    paths = aot_step.artifact_paths(d, target.model, shapes, linears=int8_layer_classes(target.model), layout=True)
    return not all(p.is_file() for p in paths)


def build(spec: MethodSpec, target, cfg: SelfSpecConfig, ctx: BuildContext) -> SelfSpecDrafter:
    skip, gamma, source, priors, vocab, kernels = resolve_skip(target, cfg)
    budget = chain_budget(target, cfg.auto_k, gamma.max_draft, ctx.measure)
    lm_head, layers = draft_parts(target, vocab, kernels, skip)
    drafter = SelfSpecDrafter(target.model, skip, budget, cfg.draft_exit, gamma, cfg.auto_k, cfg.min_confidence,
                              source, lm_head, layers)
    drafter.warm_up(MIN_CAPACITY)  # a compiled draft step: compiled or loaded now, not mid-request
    if priors is not None and budget.profile is not None:  # start from what the search measured
        cost = priors[1]
        if lm_head is not None or layers is not None:  # the draft runs otherwise than it was searched
            cost = cached_draft_ratio(target, skip, drafter.draft_model, lm_head, drafter.draft_step, vocab,
                                      kernels, ctx.measure) or cost
        budget.set_prior(priors[0], cost * budget.profile.t1)
    return drafter


INT8_SELF_DRAFT = {"skip_attention": (), "skip_mlp": (), "draft_kernels": "int8"}
"""``self-spec``'s options where the model has no skip config: the whole model in int8 drafts
(nothing skipped), so a model with no shipped or tuned artefact still has a self-draft."""


def _auto_options(name: str, target, ctx: AutoContext) -> dict | None:
    """``auto``'s candidacy: the tuned skip config where there is one (drafts on each precision),
    else the int8 self-draft (:data:`INT8_SELF_DRAFT`) where int8 kernels run here."""
    from ..kernels.switch import draft_precisions

    try:
        if find(target.name, target.model, "") is not None:
            return {}
    except SelfspecError:  # a config for another architecture: the int8 self-draft instead
        pass
    usable = ctx.draft_precisions if ctx.draft_precisions is not None else draft_precisions(target.device.type)[0]
    return dict(INT8_SELF_DRAFT) if "int8" in usable else None


SPEC = MethodSpec("self-spec", SelfSpecConfig, build, True,
                  "Draft & Verify: the model drafts with some sub-layers skipped (tuned skip config)",
                  auto=AutoCandidacy(_auto_options, "draft_kernels", DRAFT_KERNELS),  # bf16 where native
                  draft_step=draft_step_missing,  # an int8 draft of the whole model drafts through a compiled step
                  draft_forwards=True)  # its draft forwards run in each request's thread (not batched)
