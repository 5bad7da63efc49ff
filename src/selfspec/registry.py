"""Explicit registry: method name -> (config class, drafter builder, help text)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from .core.cost import load_or_measure
from .drafters.base import Drafter, NullDrafter
from .drafters.budget import ChainBudget
from .drafters.draft_model import DraftModelConfig, DraftModelDrafter, check_same_tokenizer
from .drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from .errors import SelfspecError
from .models.loading import LoadedModel, load_model


@dataclass(frozen=True)
class NoOptions:
    """``ar`` takes no options."""


@dataclass(frozen=True)
class BuildContext:
    """What builders may use besides the target: how to load further models."""

    device: object
    dtype: object
    trust_remote_code: bool
    kernels: str = "stock"


@dataclass(frozen=True)
class MethodSpec:
    config_cls: type
    build: Callable[[LoadedModel, object, BuildContext], Drafter]
    lossless: bool
    help: str


def _build_ar(target: LoadedModel, cfg: NoOptions, ctx: BuildContext) -> Drafter:
    return NullDrafter()


def _budget(target: LoadedModel, auto_k: bool, k: int) -> ChainBudget:
    profile = load_or_measure(target.model, target.name, target.backend) if auto_k else None
    return ChainBudget(profile, k)


def _build_pld(target: LoadedModel, cfg: PromptLookupConfig, ctx: BuildContext) -> Drafter:
    if cfg.min_ngram < 1 or cfg.max_ngram < cfg.min_ngram or cfg.k < 1:
        raise SelfspecError("pld needs 1 <= min_ngram <= max_ngram and k >= 1")
    return PromptLookupDrafter(cfg, _budget(target, cfg.auto_k, cfg.k))


def _build_draft_model(target: LoadedModel, cfg: DraftModelConfig, ctx: BuildContext) -> Drafter:
    if not cfg.draft_model:
        raise SelfspecError("method draft-model needs a draft: --draft-model NAME (e.g. qwen2.5-coder-0.5b-instruct)")
    if cfg.k < 1:
        raise SelfspecError("draft-model needs k >= 1")
    draft = load_model(cfg.draft_model, ctx.device, ctx.dtype, ctx.trust_remote_code, kernels=ctx.kernels,
                       release_fp32=True)
    check_same_tokenizer(target.tokenizer, draft.tokenizer, target.model.config.vocab_size,
                         draft.model.config.vocab_size, cfg.draft_model)
    if not 0.0 <= cfg.min_confidence < 1.0:
        raise SelfspecError("draft-model needs 0 <= min_confidence < 1")
    return DraftModelDrafter(draft.model, target.model.config.vocab_size, _budget(target, cfg.auto_k, cfg.k),
                             cfg.min_confidence if cfg.auto_k else 0.0)


METHODS: dict[str, MethodSpec] = {
    "ar": MethodSpec(NoOptions, _build_ar, True, "plain autoregressive decoding on the same loop (the baseline)"),
    "pld": MethodSpec(PromptLookupConfig, _build_pld, True, "prompt lookup: drafts copied from earlier text"),
    "draft-model": MethodSpec(DraftModelConfig, _build_draft_model, True,
                              "a smaller model with the same tokenizer drafts (--draft-model)"),
}


def method_config(method: str, options: dict) -> object:
    """Validate ``options`` against the method's config class."""
    if method not in METHODS:
        raise SelfspecError(f"unknown method '{method}'; choose one of: {', '.join(METHODS)}")
    cls = METHODS[method].config_cls
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        valid = ", ".join(sorted(names)) or "none"
        raise SelfspecError(f"method '{method}' has no option {unknown[0]!r}; its options are: {valid}")
    try:
        return cls(**options)
    except TypeError as e:
        raise SelfspecError(f"bad options for method '{method}': {e}") from e
