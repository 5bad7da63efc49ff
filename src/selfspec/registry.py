"""Explicit registry: method name -> (config class, drafter builder, help text)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .core.cost import load_or_measure
from .drafters.base import Drafter, NullDrafter
from .drafters.budget import ChainBudget
from .drafters.draft_model import DraftModelConfig, DraftModelDrafter, check_same_tokenizer
from .drafters.eagle import EagleConfig, EagleDrafter
from .drafters.jacobi import JacobiConfig, JacobiDrafter
from .drafters.msn import MsnConfig, MsnDrafter
from .drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from .drafters.sdsat import SdsatConfig, SdsatDrafter, check_ids, parse_tree
from .drafters.self_spec import DRAFT_EXITS, SelfSpecConfig, SelfSpecDrafter
from .drafters.skip_config import GammaSettings, find
from .drafters.space import SpaceConfig, SpaceDrafter, step_tokens
from .errors import SelfspecError
from .models.loading import LoadedModel, load_model
from .models.skipping import SkipSet, decoder_layers


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


def resolve_skip(target: LoadedModel, cfg: SelfSpecConfig
                 ) -> tuple[SkipSet, GammaSettings, str, tuple[float, float] | None]:
    """The skip set, gamma settings, source and measured priors (acceptance, draft cost / T(1))
    of ``self-spec``: explicit sets (no priors), else a skip config."""
    num_layers = len(decoder_layers(target.model))
    if cfg.skip_attention is not None or cfg.skip_mlp is not None:
        skip = SkipSet.of(_layers(cfg.skip_attention), _layers(cfg.skip_mlp))
        gamma, source, priors = GammaSettings(), "explicit", None
    else:
        found = find(target.name, target.model, cfg.skip_config)
        if found is None:
            raise SelfspecError(
                f"no skip config for model '{target.name}': tune one with `selfspec tune {target.name} --method "
                "self-spec`, or pass --skip-config PATH (API: skip_attention=..., skip_mlp=...)")
        sc, source = found
        skip, gamma, priors = sc.skip, sc.gamma, sc.priors()
    skip.check(num_layers)
    over = {k: v for k, v in (("gamma0", cfg.gamma0), ("alpha", cfg.alpha)) if v is not None}
    if cfg.k is not None:
        over["max_draft"] = cfg.k
    return skip, dataclasses.replace(gamma, **over), source, priors


def _build_self_spec(target: LoadedModel, cfg: SelfSpecConfig, ctx: BuildContext) -> Drafter:
    if cfg.draft_exit not in DRAFT_EXITS:
        raise SelfspecError(f"self-spec draft_exit must be one of {', '.join(DRAFT_EXITS)}, not {cfg.draft_exit!r}")
    if cfg.k is not None and cfg.k < 1:
        raise SelfspecError("self-spec needs k >= 1")
    if not 0.0 <= cfg.min_confidence < 1.0:
        raise SelfspecError("self-spec needs 0 <= min_confidence < 1")
    skip, gamma, source, priors = resolve_skip(target, cfg)
    budget = _budget(target, cfg.auto_k, gamma.max_draft)
    if priors is not None and budget.profile is not None:  # start from what the search measured
        budget.set_prior(priors[0], priors[1] * budget.profile.t1)
    return SelfSpecDrafter(target.model, skip, budget, cfg.draft_exit, gamma, cfg.auto_k, cfg.min_confidence,
                           source)


def _head(target: LoadedModel, cfg: EagleConfig, method: str):
    """The head of ``eagle2`` / ``hass``: ``cfg.head`` (a directory, or ``random`` for an untrained
    head: tests and lower bounds), else the trained one in ``$SELFSPEC_HOME/heads``, else the one
    shipped with the package."""
    import torch

    from .heads import find_head_dir
    from .heads.eagle import EagleHead, load_head

    if cfg.head.startswith("random"):
        try:
            seed = int(cfg.head.partition(":")[2] or 0)
        except ValueError as e:
            raise SelfspecError(f"head {cfg.head!r}: use random or random:SEED (an integer)") from e
        with torch.random.fork_rng(devices=[]):  # the caller's RNG stays untouched
            torch.manual_seed(seed)
            return EagleHead(target.model).eval(), f"random:{seed}"
    found = None if cfg.head else find_head_dir(target.name, method)
    if not cfg.head and found is None:
        raise SelfspecError(
            f"no trained {method} head for model '{target.name}': train one with `bash scripts/train_hass.sh` "
            f"(or `selfspec train hass --model {target.name} --out DIR`) and pass head=DIR (--head DIR)")
    path = cfg.head or str(found)
    if cfg.head and not Path(cfg.head).exists():  # a file: load_head says so
        raise SelfspecError(f"head directory {cfg.head} does not exist; pass a directory written by "
                            "`selfspec train hass` (--head DIR)")
    head, _ = load_head(path, target.model)
    return head, path


def _build_eagle(method: str):
    def build(target: LoadedModel, cfg: EagleConfig, ctx: BuildContext) -> Drafter:
        if cfg.top_k < 1 or cfg.depth < 0 or cfg.total_tokens < 0 or cfg.max_tokens < 2:
            raise SelfspecError(f"{method} needs top_k >= 1, depth >= 0, total_tokens >= 0 and max_tokens >= 2")
        if not 0.0 <= cfg.min_prob < 1.0:
            raise SelfspecError(f"{method} needs 0 <= min_prob < 1")
        head, source = _head(target, cfg, method)
        profile = None if cfg.total_tokens else load_or_measure(target.model, target.name, target.backend)
        return EagleDrafter(method, target.model, head, cfg, profile, source)
    return build


def adaptive_ids(target: LoadedModel, cfg: SdsatConfig) -> tuple[list[int], dict | None]:
    """The adaptive token ids of ``sdsat``: ``cfg.adaptive_ids``, else the model directory's
    ``selfspec_finetune.json`` (with that file's metadata)."""
    from .train.finetune import read_meta

    vocab = target.model.get_input_embeddings().weight.shape[0]
    meta = read_meta(target.path)
    if cfg.adaptive_ids:
        try:
            ids = [int(x) for x in str(cfg.adaptive_ids).replace("+", ",").split(",") if x.strip()]
        except ValueError as e:
            raise SelfspecError(f"sdsat adaptive_ids {cfg.adaptive_ids!r}: use integer ids like 49152 or 5,6") from e
        return check_ids(ids, vocab), meta
    if meta is None or meta.get("method") != "sdsat":
        raise SelfspecError(
            f"model '{target.name}' was not fine-tuned for sdsat (no sdsat selfspec_finetune.json): use "
            "--model smollm2-135m-instruct-sdsat, train one with `selfspec train sdsat --model M --out DIR`, "
            "or name the adaptive token with adaptive_ids=ID")
    return check_ids(list(meta["new_ids"]), vocab), meta


def _build_sdsat(method: str):
    def build(target: LoadedModel, cfg: SdsatConfig, ctx: BuildContext) -> Drafter:
        if cfg.k < 0 or cfg.max_k < 1 or cfg.candidates < 1:
            raise SelfspecError(f"{method} needs k >= 0, max_k >= 1 and candidates >= 1")
        parse_tree(cfg.tree)
        ids, meta = adaptive_ids(target, cfg)
        val = (meta or {}).get("validation", {})
        prior = [val[f"acc{j}"] for j in range(2, (cfg.k or cfg.max_k) + 2) if f"acc{j}" in val]
        profile = load_or_measure(target.model, target.name, target.backend) if cfg.k == 0 else None
        return SdsatDrafter(method, ids, cfg, profile, prior)
    return build


def space_mask_id(target: LoadedModel, cfg: SpaceConfig) -> tuple[int, dict | None]:
    """The ``[MASK]`` id of ``space``: ``cfg.mask_id``, else the model directory's
    ``selfspec_finetune.json`` (with that file's metadata)."""
    from .train.finetune import read_meta

    vocab = target.model.get_input_embeddings().weight.shape[0]
    meta = read_meta(target.path)
    if cfg.mask_id >= 0:
        return check_ids([cfg.mask_id], vocab)[0], meta
    if meta is None or meta.get("method") != "space":
        raise SelfspecError(
            f"model '{target.name}' was not fine-tuned for space (no space selfspec_finetune.json): use "
            "--model smollm2-135m-instruct-space, train one with `selfspec train space --model M --out DIR`, "
            "or name the mask token with mask_id=ID")
    return check_ids(list(meta["new_ids"]), vocab)[0], meta


def _build_space(method: str):
    def build(target: LoadedModel, cfg: SpaceConfig, ctx: BuildContext) -> Drafter:
        if cfg.k < 0 or cfg.max_k < 1:
            raise SelfspecError(f"{method} needs k >= 0 and max_k >= 1")
        mask_id, meta = space_mask_id(target, cfg)
        val = (meta or {}).get("validation", {})
        prior = [val[f"acc{j}"] for j in range(2, (cfg.k or cfg.max_k) + 2) if f"acc{j}" in val]
        extra = tuple(step_tokens(k) for k in range(2, cfg.max_k + 1))  # masked forwards: up to 1 + k(k + 2)
        profile = load_or_measure(target.model, target.name, target.backend, extra_qs=extra) if cfg.k == 0 else None
        return SpaceDrafter(method, mask_id, cfg, profile, prior)
    return build


def _build_jacobi(target: LoadedModel, cfg: JacobiConfig, ctx: BuildContext) -> Drafter:
    if cfg.m < 1:
        raise SelfspecError("jacobi needs m >= 1 guesses")
    return JacobiDrafter(cfg, _budget(target, cfg.auto_m, cfg.m))


def _build_msn(target: LoadedModel, cfg: MsnConfig, ctx: BuildContext) -> Drafter:
    if cfg.tree_size < 0 or cfg.max_nodes < 1 or cfg.ngram < 1:
        raise SelfspecError("msn needs tree_size >= 0 (0 = from the cost profile), max_nodes >= 1 and ngram >= 1")
    extra = tuple(q for q in (24, 32, 48, 69) if q <= cfg.max_nodes + 1)  # price the tree sizes it may verify
    profile = load_or_measure(target.model, target.name, target.backend, extra_qs=extra) if cfg.tree_size == 0 else None
    return MsnDrafter(cfg, profile)


METHODS: dict[str, MethodSpec] = {
    "ar": MethodSpec(NoOptions, _build_ar, True, "plain autoregressive decoding on the same loop (the baseline)"),
    "pld": MethodSpec(PromptLookupConfig, _build_pld, True, "prompt lookup: drafts copied from earlier text"),
    "draft-model": MethodSpec(DraftModelConfig, _build_draft_model, True,
                              "a smaller model with the same tokenizer drafts (--draft-model)"),
    "self-spec": MethodSpec(SelfSpecConfig, _build_self_spec, True,
                            "Draft & Verify: the model drafts with some sub-layers skipped (tuned skip config)"),
    "eagle2": MethodSpec(EagleConfig, _build_eagle("eagle2"), True,
                         "EAGLE-2: a one-layer draft head (EAGLE-trained) expands a dynamic draft tree (--head)"),
    "hass": MethodSpec(EagleConfig, _build_eagle("hass"), True,
                       "HASS: EAGLE-2 trees from a head trained with harmonized objectives (--head)"),
    "sdsat": MethodSpec(SdsatConfig, _build_sdsat("sdsat"), True,
                        "SDSAT: a fine-tuned model drafts k tokens from k appended adaptive tokens, then verifies "
                        "them (two-step loop; sampling: the paper's tree with lossless acceptance)"),
    "sdsat-lossy": MethodSpec(SdsatConfig, _build_sdsat("sdsat-lossy"), False,
                              "NOT LOSSLESS when sampling: SDSAT with the paper's sample-and-match verifier "
                              "(greedy is still exact); for reproducing the paper"),
    "jacobi": MethodSpec(JacobiConfig, _build_jacobi, True,
                         "Jacobi decoding: the model refines m guesses in parallel (ahead noise in free slots); "
                         "best on an MSN fine-tune"),
    "msn": MethodSpec(MsnConfig, _build_msn, True,
                      "MSN's TR-Jacobi: a tree of last step's top-k predictions plus a prompt-lookup chain, "
                      "verified in one forward; best on an MSN fine-tune (selfspec train msn)"),
    "space": MethodSpec(SpaceConfig, _build_space("space"), True,
                        "SPACE: a fine-tuned model drafts k tokens from k [MASK] tokens and verifies the last "
                        "step's drafts in the same forward (sampling: lossless residual rule)"),
    "space-lossy": MethodSpec(SpaceConfig, _build_space("space-lossy"), False,
                              "NOT LOSSLESS when sampling: SPACE with the paper's rule (next token from the target "
                              "after a rejection, not the residual; greedy is still exact); for reproducing the paper"),
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
