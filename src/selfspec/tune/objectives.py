"""Objectives of ``selfspec tune --method self-spec``: how good is a skip set?

- :class:`SpeedObjective` (the paper's): decode the calibration prompts with ``self-spec`` and
  that skip set, and measure tokens per second of decoding (prefill excluded: it is always the
  full model). Noisy on a shared machine, slow, and exactly what users get.
- :class:`ProxyObjective` (cheaper, deterministic): the full model's greedy continuations of the
  calibration prompts are computed once; per skip set, one teacher-forced forward of the skipped
  model over each continuation gives, at each position, whether its argmax agrees with the
  continuation and its confidence. The decoder's exit rule is then simulated on those flags and
  the predicted speedup over ``ar`` is ``tokens / (drafts * c(z) + sum T(d + 1) / T(1))`` with
  ``c(z)`` from a measured per-sub-layer cost table (:class:`DraftCost`). Its one approximation:
  while drafting, the committed positions' KV comes from the full model, whereas the
  teacher-forced forward computes it with the skipped model (so the proxy is pessimistic).

Both score the draft as it will run: with ``--draft-kernels int8`` the skipped model's linear
layers are the int8 copy (costs and agreement both), and with ``--draft-vocab N`` its LM head
covers the reduced vocabulary.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from ..core import kv_cache
from ..core.cost import CostProfile
from ..core.timing import interleaved
from ..drafters.budget import ChainBudget, DraftRule, GammaExit
from ..drafters.skip_config import DraftCost, GammaSettings
from ..drafters.skip_draft import draft_forward
from ..drafters.vocab import DraftLMHead
from ..models.loading import Runner
from ..models.skipping import SkipSet, decoder_layers, skipped

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedConfig, StaticCache

DraftParts = tuple[DraftLMHead | None, Runner | None]  # drafters.self_spec.draft_parts


@torch.inference_mode()
def measure_draft_cost(model: torch.nn.Module, context: int = 128, reps: int = 7, parts: DraftParts | None = None
                       ) -> DraftCost:
    """Median one-token forward times with none / all attention / all MLP / all sub-layers skipped,
    with the draft's LM head and kernels (``parts``; default: the model's own)."""
    lm_head, layers = parts or (None, None)
    draft_base = layers.model if layers is not None else model
    n = len(decoder_layers(model))
    device = next(model.parameters()).device
    cache = kv_cache.new_cache(model.config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cast("PreTrainedConfig", model.config).vocab_size, (context,), generator=gen).tolist()
    model(input_ids=torch.tensor([ids], device=device), **kv_cache.cache_arg(model, cache), use_cache=True,
          logits_to_keep=1)
    sets = {"full": SkipSet(), "no_attention": SkipSet.of(range(n), ()), "no_mlp": SkipSet.of((), range(n)),
            "floor": SkipSet.of(range(n), range(n))}
    drafts = {name: skipped(draft_base, skip) for name, skip in sets.items()}
    times = interleaved({name: functools.partial(draft_forward, draft, cache, [1], context, lm_head=lm_head)
                         for name, draft in drafts.items()}, reps, warmup=0, device=device,
                        reset=lambda _: kv_cache.truncate(cache, context))
    med = {k: statistics.median(v) for k, v in times.items()}
    return DraftCost(med["full"], med["no_attention"], med["no_mlp"], med["floor"], n)


@dataclass(frozen=True)
class Evaluation:
    """One skip set's score (higher is better) and what explains it."""

    score: float
    info: dict


class SpeedObjective:
    """Measured decode tokens/s of ``self-spec`` with the skip set on the calibration prompts
    (exactly ``new_tokens`` per prompt, EOS ignored, prefill excluded)."""

    name = "speed"

    def __init__(self, target: Runner, prompts: list[list[int]], new_tokens: int, draft_exit: str,
                 gamma: GammaSettings, draft_vocab: int = 0, draft_kernels: str = "same") -> None:
        from ..api import load

        self.target, self.prompts, self.new_tokens = target, prompts, new_tokens
        self.draft_exit, self.gamma = draft_exit, gamma
        self.draft: dict[str, Any] = {"draft_vocab": draft_vocab, "draft_kernels": draft_kernels}
        self._load = load
        self.ar_tps = self._decode_tps(load(target, "ar", self_test=False))

    def _decode_tps(self, g) -> float:
        tokens, seconds = 0, 0.0
        for ids in self.prompts:
            r = g.generate(ids, max_new_tokens=self.new_tokens, ignore_eos=True)
            tokens += r.new_tokens - 1  # the first token comes from the prefill
            seconds += r.wall_s - r.prefill_s
        return tokens / seconds if seconds > 0 else 0.0

    def __call__(self, skip: SkipSet) -> Evaluation:
        g = self._load(self.target, "self-spec", self_test=False, skip_attention=skip.attention,
                       skip_mlp=skip.mlp, draft_exit=self.draft_exit, gamma0=self.gamma.gamma0,
                       alpha=self.gamma.alpha, k=self.gamma.max_draft, **self.draft)
        tps = self._decode_tps(g)
        return Evaluation(tps, {"tokens_per_s": tps, "speedup": tps / self.ar_tps if self.ar_tps else 0.0})


@dataclass(frozen=True)
class _Continuation:
    prompt_len: int  # committed rows of the cache before the continuation
    tokens: list[int]  # y_0 (pending after the prompt) .. y_n, the full model's greedy tokens
    cache: DynamicCache | StaticCache


def simulate(flags: list[bool], confidences: list[float], rule: DraftRule, draft_ratio: float,
             profile: CostProfile) -> tuple[int, float, int, int]:
    """Replay the decoder's own step rule (:class:`~selfspec.drafters.self_spec.DraftRule`: the
    budget's draft length and calibrated exit, the verified prefix, the updates) on teacher-forced
    agreement flags of one continuation.

    Args:
        flags: ``flags[i]``: the draft's argmax after ``y_i`` equals ``y_{i+1}``.
        confidences: the draft's confidence at each position.
        rule: the rule over a fresh budget and gamma exit (they learn along the continuation).
        draft_ratio: draft cost of one token in units of T(1).

    Returns:
        ``(tokens, cost in units of T(1), drafted, accepted)``.
    """
    n = len(flags)
    pos = tokens = drafted = accepted = 0
    cost = 0.0
    while pos < n:
        k = rule.max_draft(n - pos)
        if k == 0:  # a plain step
            tokens, cost, pos = tokens + 1, cost + 1.0, pos + 1
            continue
        d = 0
        rule.start()
        for j in range(min(k, n - pos)):
            d += 1
            if rule.stop_after(confidences[pos + j]):
                break
        confs = confidences[pos : pos + d]
        keep = rule.verify_count(confs)
        a = 0
        while a < keep and flags[pos + a]:
            a += 1
        tokens += a + 1
        drafted += keep
        accepted += a
        cost += d * draft_ratio + profile.ratio(keep + 1)
        rule.update(keep, a, d * draft_ratio * profile.t1, d, confs)
        pos += a + 1
    return tokens, cost, drafted, accepted


class ProxyObjective:
    """Predicted speedup over ``ar`` from teacher-forced agreement (see the module docstring)."""

    name = "proxy"

    def __init__(self, target: Runner, prompts: list[list[int]], new_tokens: int, draft_exit: str,
                 gamma: GammaSettings, profile: CostProfile, draft_cost: DraftCost,
                 min_confidence: float = 0.3, parts: DraftParts | None = None) -> None:
        self.model = target.model
        self.lm_head, layers = parts or (None, None)
        self.draft_base = layers.model if layers is not None else self.model
        self.draft_exit, self.gamma, self.profile, self.draft_cost = draft_exit, gamma, profile, draft_cost
        self.min_confidence = min_confidence
        self.device = next(self.model.parameters()).device
        from ..api import load

        self.ar = load(target, "ar", self_test=False)
        self.continuations = [self._continue(ids, new_tokens) for ids in prompts]

    @torch.inference_mode()
    def _continue(self, ids: list[int], n: int) -> _Continuation:
        """The full model's greedy continuation of ``ids`` (n + 1 tokens, from ``ar`` on the one
        decode loop) and a cache holding the prompt."""
        tokens = self.ar.generate(ids, max_new_tokens=n + 1, ignore_eos=True).token_ids
        cache = kv_cache.new_cache(self.model.config)
        self.model(input_ids=torch.tensor([ids], device=self.device), **kv_cache.cache_arg(self.model, cache),
                   use_cache=True, logits_to_keep=1)
        return _Continuation(len(ids), tokens, cache)

    @torch.inference_mode()
    def agreement(self, skip: SkipSet) -> list[tuple[list[bool], list[float]]]:
        """Per continuation: agreement flags and confidences of the skipped model."""
        result = []
        draft = skipped(self.draft_base, skip)  # a module tree of its own: the model is left as it is
        for c in self.continuations:
            try:
                logits = draft_forward(draft, c.cache, c.tokens[:-1], c.prompt_len, last_only=False,
                                       lm_head=self.lm_head)
            finally:
                kv_cache.truncate(c.cache, c.prompt_len)
            probs = logits.softmax(-1)
            conf, top = probs.max(-1)
            if self.lm_head is not None:
                top = self.lm_head.to_target(top)
            result.append(((top == torch.tensor(c.tokens[1:], device=top.device)).tolist(), conf.tolist()))
        return result

    def __call__(self, skip: SkipSet) -> Evaluation:
        ratio = self.draft_cost.ratio(skip)
        gamma = GammaExit(self.gamma)
        budget = ChainBudget(self.profile, self.gamma.max_draft)  # as build() makes the drafter's
        budget.set_prior(budget.alpha, ratio * self.profile.t1)
        rule = DraftRule(budget, gamma, self.draft_exit, True, self.min_confidence)
        tokens = drafted = accepted = 0
        cost = 0.0
        agree = total = 0
        for flags, conf in self.agreement(skip):
            gamma.new_prompt()
            t, c, d, a = simulate(flags, conf, rule, ratio, self.profile)
            tokens, cost, drafted, accepted = tokens + t, cost + c, drafted + d, accepted + a
            agree, total = agree + sum(flags), total + len(flags)
        speedup = tokens / cost if cost > 0 else 0.0
        return Evaluation(speedup, {"predicted_speedup": speedup, "top1_agreement": agree / max(total, 1),
                                    "tau": tokens / max(tokens - accepted, 1), "draft_cost_ratio": ratio,
                                    "acceptance": accepted / max(drafted, 1)})
