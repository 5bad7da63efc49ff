"""EAGLE and HASS training losses, per alignment pass.

With ``m`` the loss mask and ``N = sum(m) + 1e-5``, ``p = softmax(lm_head(f̂))`` (draft) and
``q = softmax(lm_head(f))`` (target, the teacher):

* ``reg``  = sum_m mean_h SmoothL1(f̂, f) / N                     (EAGLE feature regression)
* ``cls``  = -sum_m sum_v q log p / N                             (EAGLE soft cross-entropy)
* ``topk`` = -sum_m sum_{v in TopK(q)} q log p / N                 (HASS harmonized distillation;
  q is the full-vocabulary softmax, not renormalised on the top K)

Per pass: ``w_reg * reg + w_cls * cls + w_topk * topk``; passes are summed with weight
``beta ** (j - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16/fp16 logits are widened; fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass(frozen=True)
class LossWeights:
    """EAGLE: ``reg=1, cls=0.1, topk=0``; HASS: ``topk=1`` (K = 10)."""

    reg: float = 1.0
    cls: float = 0.1
    topk: float = 0.0
    k: int = 10
    beta: float = 1.0


@dataclass(frozen=True)
class Teacher:
    """Target distribution at the masked positions.

    Attributes:
        probs: ``[M, V]`` q (``[M, N]`` over a reduced draft vocabulary).
        top: ``[M, K]`` indices of q's K largest entries.
        argmax: ``[M]`` the target's greedy next token (its subset index, or -1 outside it).
    """

    probs: torch.Tensor
    top: torch.Tensor
    argmax: torch.Tensor


@torch.no_grad()
def teacher(lm_head: torch.nn.Module, targets: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> Teacher:
    """``targets``: ``[M, H]`` clean target features at masked positions.

    With ``ids`` (``[N]``, a reduced draft vocabulary) q is the full softmax restricted to those
    columns (not renormalised: mass outside the subset is what the draft cannot hold), ``top``
    indexes the subset, and ``argmax`` is the subset index of the target's greedy token, -1
    where that token lies outside (never counted as agreement)."""
    q = torch.softmax(_wide(lm_head(targets)), dim=-1)
    am = q.argmax(-1)
    if ids is not None:
        where = torch.full((q.shape[-1],), -1, dtype=torch.long, device=q.device)
        where[ids] = torch.arange(ids.numel(), device=q.device)
        q, am = q[:, ids], where[am]
    top = torch.topk(q, min(k, q.shape[-1]), dim=-1).indices
    return Teacher(q, top, am)


def pass_losses(pred: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module, t: Teacher,
                w: LossWeights) -> dict[str, torch.Tensor]:
    """Losses of one pass at the masked positions.

    Args:
        pred: ``[M, H]`` predicted features.
        targets: ``[M, H]`` target features.
        lm_head: the frozen target LM head (gradients flow through it into ``pred``).
        t: the teacher at the same positions.
        w: weights.

    Returns:
        ``reg``, ``cls``, ``topk``, ``loss`` (weighted) and ``acc`` (top-1 agreement, no grad).
    """
    n = pred.shape[0] + 1e-5
    reg = F.smooth_l1_loss(_wide(pred), _wide(targets), reduction="none").mean(-1).sum() / n
    logp = torch.log_softmax(_wide(lm_head(pred)), dim=-1)
    qlogp = t.probs * logp
    cls = -qlogp.sum() / n
    topk = -qlogp.gather(-1, t.top).sum() / n
    loss = w.reg * reg + w.cls * cls + w.topk * topk
    acc = (logp.detach().argmax(-1) == t.argmax).float().mean()
    return {"reg": reg, "cls": cls, "topk": topk, "loss": loss, "acc": acc}
