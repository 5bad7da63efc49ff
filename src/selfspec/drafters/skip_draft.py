"""The draft pass of ``self-spec`` (:func:`draft_forward`: the model with sub-layers skipped, on
the committed cache) and what one draft token costs against a verify forward (the budget's prior
where the draft runs otherwise than the skip config's search measured it), measured once per
model, backend, machine and draft and then read from the profiles cache."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, cast

import torch

from ..core import kv_cache
from ..core.attention import decode_attention
from ..core.timing import interleaved
from ..models.adapter import attention_masks
from ..models.compiled_step import MIN_CAPACITY, StaticStep
from ..models.skipping import SkipSet
from .vocab import DraftLMHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def draft_forward(model: torch.nn.Module, cache, tokens: list[int], position: int,
                  last_only: bool = True, lm_head: DraftLMHead | None = None) -> torch.Tensor:
    """Feed ``tokens`` (causally) at positions ``position, position + 1, ...`` after the cache,
    whose non-skipped layers hold ``position`` rows (``model``: the draft's module tree, e.g.
    :func:`~selfspec.models.skipping.skipped`).

    The mask is explicit because cache layers differ in length while drafting (HF would read
    the length of layer 0, which may be skipped).

    Args:
        lm_head: a reduced draft LM head: the decoder runs without the model's LM head and
            this one gives the logits (``[.., N]``); None: the model's own (``[.., V]``).

    Returns:
        logits ``[1, V or N]`` of the last token (``last_only``) or ``[T, V or N]`` of every token, float.
    """
    device = next(model.parameters()).device
    t = len(tokens)
    block = torch.ones(t, t, dtype=torch.bool).tril()
    mask = attention_masks(model, position, block, None, kv_cache.capacity(cache))  # width: a static cache's, or None
    kwargs = dict(input_ids=torch.tensor([tokens], device=device),
                  position_ids=torch.arange(position, position + t, device=device)[None], attention_mask=mask,
                  **kv_cache.cache_arg(model, cache), use_cache=True)
    if lm_head is not None and lm_head.vocab is not None:
        with decode_attention(device):
            base = getattr(model, cast("PreTrainedModel", model).base_model_prefix)
            hidden = base(**kwargs).last_hidden_state[0]  # [T, H], post-norm
        return lm_head(hidden[-1:] if last_only else hidden)
    with decode_attention(device):
        out = model(**kwargs, logits_to_keep=1 if last_only else 0)
    return out.logits[0].float()


@torch.no_grad()
def measure_draft_ratio(model: torch.nn.Module, draft_model: torch.nn.Module, lm_head: DraftLMHead | None,
                        context: int = 64, reps: int = 5) -> float:
    """Median time of one draft token (``draft_model``: the skip set on the draft kernels, with the
    draft LM head) over the median of a full one-token forward of ``model``, interleaved after a
    ``context``-token cache: the draft cost prior when the draft runs otherwise than the skip
    config's search measured it."""
    from ..core.kv_cache import cache_arg, new_cache

    device = next(model.parameters()).device
    cache = new_cache(model.config)
    ids = list(range(1, context + 1))
    model(input_ids=torch.tensor([ids], device=device), **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    times = interleaved({"full": lambda: draft_forward(model, cache, [1], context),
                         "draft": lambda: draft_forward(draft_model, cache, [1], context, lm_head=lm_head)},
                        reps, device=device, reset=lambda _: kv_cache.truncate(cache, context))
    return statistics.median(times["draft"]) / max(statistics.median(times["full"]), 1e-9)


@torch.no_grad()
def measure_step_ratio(step: StaticStep, draft_step: StaticStep, context: int = 64, reps: int = 5) -> float:
    """:func:`measure_draft_ratio` on the ``compiled`` backend: median time of the draft step's
    one-token forward over the verify step's median, interleaved on one static cache after a
    ``context``-token prefix (both steps compiled or loaded beforehand)."""
    device = next(step.model.parameters()).device
    cache = step.take_cache(MIN_CAPACITY)
    ids, pos = torch.tensor([1]), torch.tensor([context])
    with torch.inference_mode():
        step.prefill(cache, torch.arange(1, context + 1), False)
        times = interleaved({"full": lambda: step.forward(cache, ids, pos, None, False, base=context),
                             "draft": lambda: draft_step.forward(cache, ids, pos, None, False, base=context)},
                            reps, device=device)
    step.give_back(cache)
    return statistics.median(times["draft"]) / max(statistics.median(times["full"]), 1e-9)


def cached_draft_ratio(target, skip: SkipSet, draft_model: torch.nn.Module, lm_head: DraftLMHead | None,
                       draft_step: StaticStep | None, vocab: int, kernels: str, measure: bool = True) -> float | None:
    """:func:`measure_draft_ratio` (:func:`measure_step_ratio` with a compiled draft step) of a
    self-spec draft (``draft_model``, skipping ``skip``, on ``kernels``), measured once per model,
    backend, machine and draft and then read from
    the profiles cache, so the budget's starting point (and with it the draft lengths under
    rejection sampling) does not depend on the clock of each load. ``measure`` off: the cached
    ratio, else None (nothing is timed or written)."""

    from ..core import store

    key = store.key(store.Kind.DRAFT_RATIO, target.model, target.name, kernels, target.cost_key,
                    sorted(skip.attention), sorted(skip.mlp), vocab, "compiled-draft" if draft_step is not None else "")
    cached = store.read(key, store.DraftRatio)
    if cached is not None:
        return cached.ratio
    if not measure:
        return None
    if draft_step is not None and target.step is not None:
        ratio = measure_step_ratio(target.step, draft_step)
    else:
        ratio = measure_draft_ratio(target.model, draft_model, lm_head)
    store.write(key, store.DraftRatio(ratio), "self-spec draft cost")
    return ratio
