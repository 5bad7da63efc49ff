"""MSN training: "Make Some Noise" (spec ``msn_draft_verify.md`` 1.1-1.2), and its plain-SFT control.

MSN changes supervised fine-tuning in its inputs only. In each example one contiguous span of
``span`` learned tokens is overwritten by *ahead noise* (each noised token a copy of a uniformly
chosen earlier token of the same, already noised, sequence); the labels stay clean and the loss
is the ordinary next-token cross-entropy over the learned tokens. The model thereby learns to
predict the right next tokens after a few wrong ones, which is what Jacobi decoding asks of it.
The noise is redrawn every time an example is seen (here: in ``make_batch``). ``span = 0`` is
plain SFT on the same data, batches and budget: the paper's control (``selfspec train sft``).

Where the span may go: every start ``s`` whose ``span`` tokens are all learned (answer tokens)
and that leaves the sequence's last token clean (the official ``randrange(P, n - L)``); an example
with no such start stays clean. Prompt tokens are never scored, in both runs (an assumption the
paper leaves open, applied identically to the control).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..core.ahead_noise import noise_span
from ..errors import SelfspecError
from .conversations import Example
from .objective_common import IGNORE, clean_targets, padded, scored_logits


@dataclass(frozen=True)
class MsnOptions:
    """MSN's knobs.

    Attributes:
        span: noised tokens per example (the paper: 4; its README: 5); 0 = plain SFT.
    """

    span: int = 4

    def check(self) -> None:
        if self.span < 0:
            raise SelfspecError("msn needs --span >= 0 (0 = plain SFT, the control)")


def span_starts(learn: torch.Tensor, span: int) -> list[int]:
    """Starts ``s`` (``>= 1``) whose ``span`` positions are all learned, ``s + span < len``."""
    n = learn.numel()
    ok = learn.bool().tolist()
    run, starts = 0, []
    for i in range(n - 1):  # the last token stays clean
        run = run + 1 if ok[i] else 0
        if run >= span and i - span + 1 >= 1:
            starts.append(i - span + 1)
    return starts


def noise_example(ids: torch.Tensor, learn: torch.Tensor, span: int, rng: random.Random) -> tuple[torch.Tensor, int]:
    """``([L] noised input ids, start)`` (start -1 when the example has no room for the span)."""
    starts = span_starts(learn, span) if span > 0 else []
    if not starts:
        return ids.clone(), -1
    s = rng.choice(starts)
    return noise_span(ids.clone(), s, span, torch.Generator().manual_seed(rng.getrandbits(62))), s


class MsnObjective:
    """The :class:`~selfspec.train.finetune.FinetuneObjective` of MSN (``span > 0``) or plain SFT.

    Validation batches are always noised with a span of ``eval_span`` (default: ``span``, or 4
    for plain SFT), drawn from the evaluation's fixed RNG (``eval_draws`` spans per held-out
    example, one per pass): MSN and its control are validated on the very same noised batches,
    so their ``noisy`` / ``acc_noisy`` / ``acc{j}`` metrics compare directly."""

    plot_keys = ("loss", "plain", "noisy")
    eval_draws = 3  # one noise span per example: 3 draws give the accuracies by noise depth 3x the positions

    def __init__(self, opts: MsnOptions, eval_span: int | None = None) -> None:
        opts.check()
        self.opts = opts
        self.eval_span = eval_span or opts.span or 4
        if self.eval_span < 1:
            raise SelfspecError("msn validation needs a noise span >= 1")
        self.name = "msn" if opts.span else "sft"
        self.new_tokens: list[str] = []
        self.pad_id = 0

    def bind(self, new_ids: list[int], pad_id: int) -> None:
        self.pad_id = pad_id

    def options(self) -> dict:
        extra = {} if self.eval_span == self.opts.span else {"eval_span": self.eval_span}
        return asdict(self.opts) | extra

    def make_batch(self, examples: list[Example], rng: random.Random) -> dict[str, torch.Tensor]:
        """``input_ids`` (noised), ``attention_mask``, ``targets`` (clean next tokens, IGNORE where
        not learned), ``noisy`` (bool: the input at this position is noise) and ``noise_depth``
        (long: 0 where clean, ``k`` at the span's k-th noised input) ``[B, L]``."""
        return self._batch(examples, rng, self.opts.span)

    def make_eval_batch(self, examples: list[Example], rng: random.Random) -> dict[str, torch.Tensor]:
        """As :meth:`make_batch`, noised with ``eval_span`` (also for plain SFT)."""
        return self._batch(examples, rng, self.eval_span)

    def _batch(self, examples: list[Example], rng: random.Random, span: int) -> dict[str, torch.Tensor]:
        inp, att, tgt = padded(examples, self.pad_id)
        depth = torch.zeros(tgt.shape, dtype=torch.long)
        for r, e in enumerate(examples):
            n = e.input_ids.numel()
            tgt[r, :n] = clean_targets(e.input_ids, e.loss_mask)
            inp[r, :n], s = noise_example(e.input_ids, e.loss_mask, span, rng)
            if s >= 0:
                depth[r, s : s + span] = torch.arange(1, span + 1)
        return {"input_ids": inp, "attention_mask": att, "targets": tgt, "noisy": depth > 0, "noise_depth": depth}

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Next-token cross-entropy over every learned position; metrics ``plain`` (positions whose
        own input is clean), ``noisy`` and ``acc_noisy`` (top-1 accuracy where the input is noise:
        the model's Jacobi-style correction, what MSN trains), and ``acc{j}`` by draft depth:
        ``acc1`` where the input is clean, ``acc{k+1}`` after the span's k-th noised input (the
        proxy of a Jacobi draft token j deep, predicted behind j - 1 guesses that may be wrong)."""
        device = next(model.parameters()).device
        tgt = batch["targets"].to(device)
        sel = tgt != IGNORE
        logits = scored_logits(model, batch["input_ids"].to(device), batch["attention_mask"].to(device), sel)
        t, depth = tgt[sel], batch["noise_depth"].to(device)[sel]
        is_noisy = depth > 0
        loss = F.cross_entropy(logits, t)
        m: dict[str, float] = {"loss": float(loss.detach()), "tokens": int(sel.sum()), "n_loss": int(sel.sum())}
        with torch.no_grad():
            ce = F.cross_entropy(logits.detach(), t, reduction="none")
            hit = logits.argmax(-1) == t
            clean = ~is_noisy
            if clean.any():
                m["plain"], m["n_plain"] = float(ce[clean].mean()), int(clean.sum())
                m["acc1"], m["n_acc1"] = float(hit[clean].float().mean()), int(clean.sum())
            if is_noisy.any():
                m["noisy"], m["n_noisy"] = float(ce[is_noisy].mean()), int(is_noisy.sum())
                m["acc_noisy"], m["n_acc_noisy"] = float(hit[is_noisy].float().mean()), int(is_noisy.sum())
            for k in range(1, int(depth.max()) + 1):
                at = depth == k
                if at.any():
                    m[f"acc{k + 1}"], m[f"n_acc{k + 1}"] = float(hit[at].float().mean()), int(at.sum())
        return loss, m
