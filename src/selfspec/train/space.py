"""SPACE training: semi-autoregressive SFT with ``[MASK]`` tokens (paper section 3.1 / 4.1; spec
``sdsat_space.md`` 2.1).

One new token ``[MASK]``. With probability ``p_ar`` a sequence is an ordinary SFT sample
(next-token loss on the learned tokens). Otherwise it gets mask groups, laid out by
:func:`selfspec.core.mask_groups.mask_groups` - the function the decoder uses:

* ``groups = 1`` (the official code's default path): the response is cut after a random learned
  token a (``a + 1 .. a + k + 1`` learned) and ``k`` masks are appended; real tokens after the cut
  are dropped. The output at a learns token a + 1 (ordinary AR); mask j (0-based) learns token
  a + 2 + j. (The code appends k + 1 masks; the last has no label and, under the causal mask, no
  effect, so it is left out.)
* ``groups = G > 1`` (for small budgets; the official "efficient" path generalised): the whole
  sequence keeps its AR loss and G groups of k masks are appended after it, each anchored at its
  own random cut point; the layout hides every real token after a group's anchor from it and
  every other group, so each group's loss is exactly that of a stand-alone truncated sample
  (tested).

Loss: a token-level mean of cross-entropy over every scored position, mask positions weighted by
``mask_weight`` (the code's realisation of ``p_ar L_AR + (1 - p_ar) L_SAR``; its integer
weight tensor is a float here).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from ..core.mask_groups import mask_groups
from ..errors import SelfspecError
from .conversations import Example
from .objective_common import IGNORE, clean_targets, scored_logits

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

MASK_TOKEN = "<|space_mask|>"


@dataclass(frozen=True)
class SpaceOptions:
    """SPACE's knobs (paper values as defaults, except ``groups``).

    Attributes:
        k: masks per group, i.e. tokens drafted per step (paper: 5).
        p_ar: share of sequences trained as plain SFT samples (paper: 0.5).
        groups: mask groups per masked sequence: 1 = cut and truncate (the official code), more
            = keep the sequence and supervise that many cut points (see the module docstring).
        mask_weight: loss weight of mask positions (paper: 1).
    """

    k: int = 5
    p_ar: float = 0.5
    groups: int = 1
    mask_weight: float = 1.0

    def check(self) -> None:
        if self.k < 1 or self.groups < 1 or self.mask_weight < 0:
            raise SelfspecError("space needs --masks >= 1, --groups >= 1 and --mask-weight >= 0")
        if not 0 <= self.p_ar < 1:
            raise SelfspecError("space needs 0 <= --p-ar < 1 (some sequences must carry masks)")


@dataclass(frozen=True)
class Sample:
    """One training sequence with its mask groups.

    Attributes:
        real: ``[n]`` real token ids (truncated at the cut when ``groups = 1``).
        anchors: the G cut points (indices into ``real``); empty for an AR sample.
        targets: ``[n + G*k]`` what each output must predict, IGNORE where unscored.
        offsets: ``[n + G*k]`` 1 for next-token targets, j + 2 for mask j; 0 where unscored.
    """

    real: torch.Tensor
    anchors: list[int]
    targets: torch.Tensor
    offsets: torch.Tensor


def cut_points(learn: list[bool], k: int) -> list[int]:
    """Indices a with tokens a + 1 .. a + k + 1 all learned (a group there has k + 1 labels)."""
    n = len(learn)
    return [a for a in range(n - k - 1) if all(learn[a + 1 : a + k + 2])]


def make_sample(ids: torch.Tensor, learn: torch.Tensor, opts: SpaceOptions, rng: random.Random) -> Sample:
    """An AR sample (probability ``p_ar``, or no room for a group) or a masked one.

    Args:
        ids: ``[L]`` int64 tokens.
        learn: ``[L]`` bool, tokens the model is trained on.
        opts: the method's options.
        rng: the draws (AR or not, cut points).
    """
    learn_l = [bool(x) for x in learn.tolist()]
    ar_targets = clean_targets(ids, learn)
    cuts = cut_points(learn_l, opts.k)
    if rng.random() < opts.p_ar or not cuts:
        off = (ar_targets != IGNORE).long()
        return Sample(ids, [], ar_targets, off)
    if opts.groups == 1:
        a = rng.choice(cuts)
        real, anchors = ids[: a + 1], [a]
        tgt_real = ar_targets[: a + 1]
    else:
        anchors = sorted(rng.sample(cuts, min(opts.groups, len(cuts))))
        real, tgt_real = ids, ar_targets
    k = opts.k
    ids_l = ids.tolist()
    tgt_mask = torch.tensor([ids_l[a + 2 + j] for a in anchors for j in range(k)], dtype=torch.long)
    off_mask = torch.tensor([j + 2 for _ in anchors for j in range(k)], dtype=torch.long)
    targets = torch.cat([tgt_real, tgt_mask])
    offsets = torch.cat([(tgt_real != IGNORE).long(), off_mask])
    return Sample(real, anchors, targets, offsets)


class SpaceObjective:
    """The :class:`~selfspec.train.finetune.FinetuneObjective` of SPACE."""

    name = "space"
    plot_keys = ("loss", "plain", "mask")
    eval_draws = 1  # validation passes (see loop.Objective)

    def __init__(self, opts: SpaceOptions) -> None:
        opts.check()
        self.opts = opts
        self.new_tokens = [MASK_TOKEN]
        self.mask_id = -1
        self.pad_id = 0

    def bind(self, new_ids: list[int], pad_id: int) -> None:
        self.mask_id, self.pad_id = int(new_ids[0]), pad_id

    def options(self) -> dict:
        return asdict(self.opts)

    def make_batch(self, examples: list[Example], rng: random.Random) -> dict[str, torch.Tensor]:
        """``input_ids``, ``position_ids``, ``targets``, ``offsets`` ``[B, T]`` and ``block``
        ``[B, T, T]`` bool (who sees whom), T = longest real part + most groups * k. Real parts
        are right-padded; unused group slots see only themselves and are never scored."""
        k = self.opts.k
        samples = [make_sample(e.input_ids, e.loss_mask.bool(), self.opts, rng) for e in examples]
        n = max(s.real.numel() for s in samples)
        g = max(len(s.anchors) for s in samples)
        t = n + g * k
        b = len(samples)
        inp = torch.full((b, t), self.pad_id, dtype=torch.long)
        pos = torch.zeros(b, t, dtype=torch.long)
        tgt = torch.full((b, t), IGNORE, dtype=torch.long)
        off = torch.zeros(b, t, dtype=torch.long)
        block = torch.eye(t, dtype=torch.bool).repeat(b, 1, 1)
        for r, s in enumerate(samples):
            m = s.real.numel()
            # the shared layout over the padded real part (anchors < m, so pads are never seen by masks)
            blk, rel = mask_groups(n, s.anchors, k)
            size = n + len(s.anchors) * k
            block[r, :size, :size] = blk
            inp[r, :m] = s.real
            inp[r, n:size] = self.mask_id
            pos[r, :n] = torch.arange(n)
            pos[r, n:size] = rel
            tgt[r, :m], off[r, :m] = s.targets[:m], s.offsets[:m]
            tgt[r, n:size], off[r, n:size] = s.targets[m:], s.offsets[m:]
        return {"input_ids": inp, "position_ids": pos, "block": block, "targets": tgt, "offsets": off}

    def make_eval_batch(self, examples: list[Example], rng: random.Random) -> dict[str, torch.Tensor]:
        """As :meth:`make_batch` (from the evaluation's fixed RNG)."""
        return self.make_batch(examples, rng)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Weighted token-mean CE; metrics ``plain`` (next-token CE), ``mask`` (mask CE) and
        ``acc{j}`` (top-1 accuracy j tokens ahead of the anchor; j >= 2 are the masks' drafts)."""
        device = next(model.parameters()).device
        tgt, off = batch["targets"].to(device), batch["offsets"].to(device)
        sel = tgt != IGNORE
        logits = masked_logits(model, batch["input_ids"].to(device), batch["position_ids"].to(device),
                               batch["block"].to(device), sel)
        t, o = tgt[sel], off[sel]
        ce = F.cross_entropy(logits, t, reduction="none")
        is_mask = o >= 2
        w = torch.where(is_mask, torch.full_like(ce, self.opts.mask_weight), torch.ones_like(ce))
        loss = (ce * w).sum() / max(1, ce.numel())
        m: dict[str, float] = {"loss": float(loss.detach()), "tokens": int(ce.numel())}
        if (~is_mask).any():
            m["plain"], m["n_plain"] = float(ce[~is_mask].detach().mean()), int((~is_mask).sum())
        if is_mask.any():
            m["mask"], m["n_mask"] = float(ce[is_mask].detach().mean()), int(is_mask.sum())
        with torch.no_grad():
            hit = logits.argmax(-1) == t
            for j in range(1, self.opts.k + 2):
                at = o == j
                if at.any():
                    m[f"acc{j}"], m[f"n_acc{j}"] = float(hit[at].float().mean()), int(at.sum())
        return loss, m


def masked_logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  block: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``[S, V]`` fp32 logits at the S positions where ``scored`` (``[B, T]``) is True, from one
    forward with the 4-D visibility ``block`` (``[B, T, T]`` bool) and explicit positions. The
    LM head runs only at scored rows (:func:`~selfspec.train.objective_common.scored_logits`)."""
    impl = cast("PreTrainedConfig", model.config)._attn_implementation
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(block.shape, dtype=dtype, device=block.device).masked_fill(~block, torch.finfo(dtype).min)
    else:
        mask = block
    return scored_logits(model, input_ids, mask[:, None], scored, position_ids)
