"""Pieces shared by the fine-tuning objectives (SDSAT, SPACE, MSN): the ignore label, next-token
targets of a clean sequence, padded batch tensors, and logits at scored positions only."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from .conversations import Example

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IGNORE = -100


def clean_targets(ids: torch.Tensor, learn: torch.Tensor) -> torch.Tensor:
    """``[L]`` next-token targets of a clean sequence: token i + 1 where it is learned."""
    t = torch.full_like(ids, IGNORE)
    t[:-1] = torch.where(learn[1:].bool(), ids[1:], torch.full_like(ids[1:], IGNORE))
    return t


def padded(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``[B, L]`` batch tensors of right-padded examples (L = the longest): ``input_ids`` all
    ``pad_id``, ``attention_mask`` 1 on each example's tokens, ``targets`` all IGNORE."""
    b, length = len(examples), max(e.input_ids.numel() for e in examples)
    inp = torch.full((b, length), pad_id, dtype=torch.long)
    att = torch.zeros(b, length, dtype=torch.long)
    for r, e in enumerate(examples):
        att[r, : e.input_ids.numel()] = 1
    return inp, att, torch.full((b, length), IGNORE, dtype=torch.long)


def scored_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  scored: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[S, V]`` fp32 logits at the S positions where ``scored`` (``[B, L]`` bool) is True, in
    row-major order: the LM head over a 49k vocabulary is a large share of a small model's cost,
    so it runs only where a loss is taken. Uses the last entry of ``hidden_states`` (after the
    final norm in HF causal LMs) and the model's output embedding. ``attention_mask`` is the
    ``[B, L]`` padding mask or a 4-D one with explicit ``position_ids`` (SPACE's mask groups)."""
    extra = {} if position_ids is None else {"position_ids": position_ids}
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1,
                **extra)
    return cast("PreTrainedModel", model).get_output_embeddings()(out.hidden_states[-1][scored]).float()
