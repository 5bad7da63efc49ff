"""SDSAT training: semantic adaptive tokens (the paper's section 2.2; spec ``sdsat_space.md`` 1.1).

Half of each batch is left clean (ordinary next-token loss on the learned tokens, ``L_plain``).
In the other half ("mixed" sequences) about ``start_fraction`` of the learned positions are
picked as window starts; each window of ``w ~ U{1..L}`` tokens is *replaced* by the adaptive
token (windows may overlap and merge; position 0 and untrained text are never replaced). The
labels stay the original tokens and only adaptive positions are scored (``L_adaptive``):

* ``loss_at="label"`` (the paper's eq. 6, default): every adaptive position i is a label,
  predicted by the output at i - 1. The output at the j-th adaptive token of a window learns the
  token j + 1 places after the last real token - what decoding asks of it.
* ``loss_at="input"``: the output at every adaptive input i learns token i + 1 (the window's
  last adaptive token is trained too; its first label, predicted from a real token, is not).

``loss = 1/2 (L_plain + weight * L_adaptive)``, each term a mean over its scored tokens.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..errors import SelfspecError
from .conversations import Example
from .objective_common import IGNORE, clean_targets, padded, scored_logits

ADAPTIVE_TOKEN = "<|sdsat_adaptive|>"


@dataclass(frozen=True)
class SdsatOptions:
    """SDSAT's knobs (paper values as defaults).

    Attributes:
        window: L, the largest window of adaptive tokens (paper: 3, 5 or 7).
        start_fraction: share of eligible positions picked as window starts (paper: 10%).
        weight: w, the adaptive term's weight (paper: 1).
        clean_fraction: share of each batch's sequences left clean (paper: half).
        distinct: L distinct adaptive tokens (the j-th of a window uses the j-th id; the paper's
            appendix B) instead of one id repeated (the paper's main models).
        loss_at: ``label`` (eq. 6) or ``input`` (see the module docstring).
    """

    window: int = 5
    start_fraction: float = 0.1
    weight: float = 1.0
    clean_fraction: float = 0.5
    distinct: bool = False
    loss_at: str = "label"

    def check(self) -> None:
        if self.window < 1 or not 0 < self.start_fraction <= 1 or self.weight < 0:
            raise SelfspecError("sdsat needs --window >= 1, 0 < --start-fraction <= 1 and --adaptive-weight >= 0")
        if not 0 <= self.clean_fraction < 1:
            raise SelfspecError("sdsat needs 0 <= --clean-fraction < 1 (some sequences must be mixed)")
        if self.loss_at not in ("label", "input"):
            raise SelfspecError(f"--loss-at must be label or input, not {self.loss_at!r}")

    @property
    def tokens(self) -> list[str]:
        if not self.distinct:
            return [ADAPTIVE_TOKEN]
        return [f"<|sdsat_adaptive_{j}|>" for j in range(1, self.window + 1)]


@dataclass(frozen=True)
class Mixed:
    """One mixed sequence.

    Attributes:
        input_ids: ``[L]`` the sequence with the windows replaced by adaptive ids.
        targets: ``[L]`` the token the output at position i must predict, IGNORE where unscored.
        offsets: ``[L]`` how far ahead of the last real token at or before i that target is
            (1 = the ordinary next token, j + 1 for the j-th adaptive token); 0 where unscored.
        adaptive: ``[L]`` bool, replaced positions.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    offsets: torch.Tensor
    adaptive: torch.Tensor


def mix_sequence(ids: torch.Tensor, learn: torch.Tensor, adaptive_ids: list[int], opts: SdsatOptions,
                 rng: random.Random) -> Mixed:
    """Replace windows of a sequence by adaptive tokens (see the module docstring).

    Args:
        ids: ``[L]`` int64 original tokens.
        learn: ``[L]`` bool, tokens the model is trained on (only these may be replaced).
        adaptive_ids: one id, or ``window`` distinct ids.
        opts: the method's options.
        rng: the draw of starts and window sizes.
    """
    n = ids.numel()
    learn_l = learn.tolist()
    eligible = [i for i in range(1, n) if learn_l[i]]
    replaced = [False] * n
    run = [0] * n  # 1-based index of a replaced position within its (merged) window
    if eligible:
        k = max(1, round(opts.start_fraction * len(eligible)))
        for s in rng.sample(eligible, min(k, len(eligible))):
            w = rng.randint(1, opts.window)
            for i in range(s, min(n, s + w)):
                if not learn_l[i]:
                    break
                replaced[i] = True
    inp = ids.clone()
    for i in range(1, n):
        if replaced[i]:
            run[i] = run[i - 1] + 1
            inp[i] = adaptive_ids[min(run[i], len(adaptive_ids)) - 1]
    targets = torch.full((n,), IGNORE, dtype=torch.long)
    offsets = torch.zeros(n, dtype=torch.long)
    ids_l = ids.tolist()
    for i in range(1, n):
        if not replaced[i]:
            continue
        if opts.loss_at == "label":  # label i, predicted at i - 1 (run[i] - 1 adaptive tokens before it)
            targets[i - 1], offsets[i - 1] = ids_l[i], run[i]
        elif i + 1 < n and learn_l[i + 1]:  # the output at adaptive input i predicts i + 1
            targets[i], offsets[i] = ids_l[i + 1], run[i] + 1
    return Mixed(inp, targets, offsets, torch.tensor(replaced))


class SdsatObjective:
    """The :class:`~selfspec.train.finetune.FinetuneObjective` of SDSAT."""

    name = "sdsat"
    plot_keys = ("loss", "plain", "adapt")
    eval_draws = 1  # validation passes (see loop.Objective)

    def __init__(self, opts: SdsatOptions) -> None:
        opts.check()
        self.opts = opts
        self.new_tokens = opts.tokens
        self.adaptive_ids: list[int] = []
        self.pad_id = 0

    def bind(self, new_ids: list[int], pad_id: int) -> None:
        self.adaptive_ids, self.pad_id = list(new_ids), pad_id

    def options(self) -> dict:
        return asdict(self.opts)

    def make_batch(self, examples: list[Example], rng: random.Random) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``targets``, ``offsets`` ``[B, L]`` and ``mixed [B]``
        (B * clean_fraction rows, chosen at random, stay clean)."""
        b = len(examples)
        n_clean = int(round(b * self.opts.clean_fraction)) if b > 1 else int(rng.random() < self.opts.clean_fraction)
        clean = set(rng.sample(range(b), n_clean))
        inp, att, tgt = padded(examples, self.pad_id)
        off = torch.zeros_like(tgt)
        for r, e in enumerate(examples):
            n = e.input_ids.numel()
            if r in clean:
                inp[r, :n] = e.input_ids
                tgt[r, :n] = clean_targets(e.input_ids, e.loss_mask)
            else:
                m = mix_sequence(e.input_ids, e.loss_mask.bool(), self.adaptive_ids, self.opts, rng)
                inp[r, :n], tgt[r, :n], off[r, :n] = m.input_ids, m.targets, m.offsets
        mixed = torch.tensor([r not in clean for r in range(b)])
        return {"input_ids": inp, "attention_mask": att, "targets": tgt, "offsets": off, "mixed": mixed}

    def make_eval_batch(self, examples: list[Example], rng: random.Random) -> dict[str, torch.Tensor]:
        """As :meth:`make_batch` (from the evaluation's fixed RNG)."""
        return self.make_batch(examples, rng)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """``1/2 (L_plain + w L_adaptive)``; metrics ``plain``, ``adapt``, ``acc{j}`` (top-1 accuracy
        of the prediction j tokens ahead of the last real token, j >= 2 are adaptive drafts)."""
        device = next(model.parameters()).device
        tgt, off = batch["targets"].to(device), batch["offsets"].to(device)
        mixed = batch["mixed"].to(device)[:, None].expand_as(tgt)
        plain_sel = (~mixed) & (tgt != IGNORE)
        adapt_sel = mixed & (tgt != IGNORE)
        sel = plain_sel | adapt_sel
        logits = scored_logits(model, batch["input_ids"].to(device), batch["attention_mask"].to(device), sel)
        t, o, is_plain = tgt[sel], off[sel], plain_sel[sel]
        zero = logits.sum() * 0
        plain = F.cross_entropy(logits[is_plain], t[is_plain]) if is_plain.any() else zero
        adapt = F.cross_entropy(logits[~is_plain], t[~is_plain]) if (~is_plain).any() else zero
        loss = 0.5 * (plain + self.opts.weight * adapt)
        m: dict[str, float] = {"loss": float(loss.detach()), "plain": float(plain.detach()),
                               "adapt": float(adapt.detach()), "tokens": int(sel.sum()),
                               "n_plain": int(plain_sel.sum()), "n_adapt": int(adapt_sel.sum()),
                               "n_loss": int(sel.sum())}
        with torch.no_grad():
            hit = logits.argmax(-1) == t
            for j in range(1, self.opts.window + 2):
                at = ~is_plain & (o == j)
                if at.any():
                    m[f"acc{j}"] = float(hit[at].float().mean())
                    m[f"n_acc{j}"] = int(at.sum())
        return loss, m
