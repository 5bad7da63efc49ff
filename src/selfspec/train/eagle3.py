"""Training an EAGLE-3 head (:class:`~selfspec.heads.eagle3.Eagle3Head`) with training-time test,
on the shared Accelerate loop (:mod:`.loop`), with HASS's top-K distillation and detached
context alignment as options.

A batch pairs the cached fused target features ``F_t`` (``[3·H]``: the hidden states at the
head's three feature layers) with the next token ``x_{t+1}``, and keeps the target's post-norm
last hidden state, from which the teacher's logits come.

**Training-time test** (EAGLE-3): the head is unrolled for ``steps`` steps over every position
at once. Step 0 runs ``fc(F_t)`` with ``x_{t+1}`` at position t; step j feeds back, at every row
t, the step j-1 output of that row with the token ``x_{t+j+1}`` at position ``t + j``, and
predicts ``x_{t+j+2}``. Its attention sees the step-0 keys of positions ``<= t`` (the true
context) and the keys of steps 1..j at row t (the chain drafted so far): exactly what drafting
sees after the catch-up on the true features up to t and j drafted steps (tested in fp64,
``tests/heads/test_eagle3.py``). This is HASS's harmonized context alignment indexed by the chain
start instead of the drafted position. The steps run on the stock midlayer with a plain
``DynamicCache``: step j appends its keys after those of steps 0..j-1 and a boolean mask picks
the causal block of step 0 and the diagonals of steps 1..j.

**Losses** per step j (weight ``step_weight ** j``, EAGLE-3's 0.8): the soft cross-entropy
``-sum_v q(v) log p(v)`` with ``q`` the target's distribution at position ``t + j + 1``
renormalised over the draft vocabulary and ``p`` the head's, at positions whose next token is
learned and whose target argmax lies in the draft vocabulary (EAGLE-3's mask); plus, with
``topk_weight`` w, HASS's top-K distillation ``-w sum_{v in TopK(q)} q(v) log p(v)``. With
``detach`` (HASS, ``--objective hass``), each step's fed-back hidden state enters the next step
detached, as the HASS code does with its passes; EAGLE-3 back-propagates through the chain.
``acc{j}`` is the top-1 agreement of step j with the target's full-vocabulary argmax.

The draft vocabulary is the ``draft_vocab`` most frequent learned (loss-masked) tokens of the
training data plus the model's EOS ids (:func:`selfspec.train.trainer.training_vocab`, as for
EAGLE-2 heads), EAGLE-3 style; the head's ``lm_head`` starts from the target's LM-head rows of those tokens and its
``norm`` from the target's final norm.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from transformers import DynamicCache

from ..core.draft_vocab import DraftVocab
from ..errors import SelfspecError
from ..heads.checkpoints import load_draft_head
from ..heads.eagle3 import Eagle3Head
from . import loop
from .features import CachedSequence
from .options import TrainingOptions
from .trainer import recorded_options, training_vocab, with_feature_noise

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class Eagle3Options(TrainingOptions):
    """Hyper-parameters of EAGLE-3 head training (``docs/methods/hass.md`` "EAGLE-3 heads").

    Attributes:
        objective: ``eagle`` (EAGLE-3: back-propagation through the unrolled steps, no top-K
            loss) or ``hass`` (top-K loss, detached steps); names the head's method.
        steps: training-time-test steps (EAGLE-3: 7).
        step_weight: step j's loss weight ``step_weight ** j``.
        topk: K of the top-K distillation loss.
        topk_weight: its weight w (0 = off).
        detach: feed each step's output to the next one detached (HASS).
        draft_vocab: N, the LM head's vocabulary (0 or >= V: the full vocabulary).
        feature_layers: the three ``hidden_states`` indices (resolved; the cache's).
        epochs, max_steps, lr, batch_size, noise, clip, weight_decay, warmup, val_fraction, seed,
        checkpoint_every, init: as :class:`~selfspec.train.trainer.TrainOptions`.
    """

    objective: str = "eagle"
    steps: int = 7
    step_weight: float = 0.8
    topk: int = 10
    topk_weight: float = 0.0
    detach: bool = False
    draft_vocab: int = 0
    feature_layers: tuple[int, ...] = ()
    noise: float = 0.0
    init: str = ""


@dataclass(frozen=True)
class Batch3:
    """Training tensors of B right-padded sequences.

    Attributes:
        features: ``[B, L, 3·H]`` fused target features ``F_t`` (noise is added for training).
        next_tokens: ``[B, L]`` int64 ``x_{t+1}`` (0 past the end).
        last: ``[B, L, H]`` the target's post-norm last hidden state (the teacher's input).
        learn: ``[B, L]`` bool: the teacher at position p is trained on (``x_{p+1}`` is learned).
    """

    features: torch.Tensor
    next_tokens: torch.Tensor
    last: torch.Tensor
    learn: torch.Tensor


def collate3(seqs: Sequence[CachedSequence], dtype: torch.dtype = torch.float32) -> Batch3:
    b, length = len(seqs), max(s.input_ids.numel() for s in seqs)
    if any(s.last is None for s in seqs):
        raise SelfspecError("the feature cache holds no last hidden states: it was extracted for an EAGLE-2 head; "
                            "extract EAGLE-3 features (selfspec train hass --arch eagle3)")
    feats = torch.zeros(b, length, seqs[0].features.shape[-1], dtype=dtype)
    last = torch.zeros(b, length, seqs[0].last.shape[-1], dtype=dtype)  # type: ignore[union-attr]
    nxt = torch.zeros(b, length, dtype=torch.long)
    learn = torch.zeros(b, length, dtype=torch.bool)
    for r, s in enumerate(seqs):
        n = s.input_ids.numel()
        feats[r, :n] = s.features.to(dtype)
        last[r, :n] = s.last.to(dtype)  # type: ignore[union-attr]
        nxt[r, : n - 1] = s.input_ids[1:]
        learn[r, : n - 1] = s.loss_mask[1:].bool()
    return Batch3(feats, nxt, last, learn)


def ttt_mask(length: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """``[L, (step + 1)·L]`` bool: what row t of step ``step`` sees over the keys of steps
    0..step (laid out step by step): step 0's positions ``<= t``, and row t of every later step."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


class Eagle3TTT(nn.Module):
    """Training wrapper: one ``forward`` unrolls all steps (one call, so DDP syncs once).

    Attributes:
        head: the EAGLE-3 head being trained.
        steps: training-time-test steps.
        detach: feed outputs back detached (HASS).
    """

    def __init__(self, head: Eagle3Head, steps: int, detach: bool = False) -> None:
        super().__init__()
        self.head, self.steps, self.detach = head, steps, detach

    def unroll(self, features: torch.Tensor, token_embeds: torch.Tensor) -> list[torch.Tensor]:
        """Every step's outputs.

        Args:
            features: ``[B, L, 3·H_t]`` fused target features ``F_0 .. F_{L-1}``.
            token_embeds: ``[B, L, H]`` embeddings of the next tokens ``x_1 .. x_L``.

        Returns:
            ``steps`` tensors ``[B, L, H]``: step j's output at row t (drafted position ``t + j``,
            predicting ``x_{t+j+2}``).
        """
        b, length, hid = token_embeds.shape
        device = features.device
        cache = DynamicCache(config=self.head.config)  # plain layers: torch.cat keeps the graph
        h, outs = features, []
        for j in range(self.steps):
            emb = token_embeds if j == 0 else torch.cat(
                [token_embeds[:, j:], token_embeds.new_zeros(b, min(j, length), hid)], dim=1)
            pos = (torch.arange(length, device=device) + j)[None].expand(b, -1)
            mask = ttt_mask(length, j, device)[None, None].expand(b, 1, -1, -1)
            out = self.head.layer_forward(self.head.project(h, emb), pos, mask, cache)
            outs.append(out)
            h = out.detach() if self.detach else out
        return outs

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, rows: Sequence[torch.Tensor]
                ) -> list[torch.Tensor]:
        """Draft-vocabulary logits ``[M_j, N]`` of step j at its scored rows ``rows[j]`` (``[B, L]``
        bool; row-major order): only there, as the LM head is a large share of the cost."""
        return [self.head.logits(out[r]) for out, r in zip(self.unroll(features, token_embeds), rows)]


@dataclass(frozen=True)
class Teacher3:
    """The target at the learned positions (``M`` rows).

    Attributes:
        probs: ``[M, N]`` q renormalised over the draft vocabulary.
        top: ``[M, K]`` indices (draft vocabulary) of q's K largest entries.
        argmax: ``[M]`` the target's greedy next token (full vocabulary).
        in_vocab: ``[M]`` bool: that token lies in the draft vocabulary.
    """

    probs: torch.Tensor
    top: torch.Tensor
    argmax: torch.Tensor
    in_vocab: torch.Tensor


@torch.no_grad()
def teacher3(lm_head: nn.Module, last: torch.Tensor, vocab: DraftVocab | None, k: int) -> Teacher3:
    """``last``: ``[M, H]`` the target's last hidden states at the learned positions."""
    logits = lm_head(last)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    amax = logits.argmax(-1)
    if vocab is not None:
        logits = logits.index_select(-1, vocab.ids_on(logits.device))
        in_vocab = vocab.t2d().to(amax.device)[amax]
    else:
        in_vocab = torch.ones_like(amax, dtype=torch.bool)
    q = torch.softmax(logits, dim=-1)
    return Teacher3(q, torch.topk(q, min(k, q.shape[-1]), dim=-1).indices, amax, in_vocab)


def compute_losses3(model: nn.Module, target: nn.Module, batch: Batch3, opts: Eagle3Options,
                    vocab: DraftVocab | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward all steps; the weighted loss and per-step metrics (module docstring)."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    learn = batch.learn.to(device)
    lm = cast("PreTrainedModel", target)
    with torch.no_grad():
        emb = lm.get_input_embeddings()(batch.next_tokens.to(device)).to(dtype)
    t = teacher3(lm.get_output_embeddings(), batch.last.to(device=device, dtype=dtype)[learn], vocab, opts.topk)
    index = torch.full(learn.shape, -1, dtype=torch.long, device=device)
    index[learn] = torch.arange(int(learn.sum()), device=device)
    length = learn.shape[1]
    rows, trows = [], []
    for j in range(opts.steps):
        shifted = index[:, j + 1 :]  # teacher row of (b, t) at step j: position t + j + 1
        r = torch.zeros_like(learn)
        r[:, : max(length - j - 1, 0)] = shifted >= 0
        rows.append(r)
        trows.append(shifted[shifted >= 0])
    logits = model(batch.features.to(device=device, dtype=dtype), emb, rows)
    total = torch.zeros((), device=device)
    metrics: dict[str, float] = {}
    for j, (lg, tr) in enumerate(zip(logits, trows), start=1):
        if tr.numel() == 0:
            continue
        logp = torch.log_softmax(lg.to(torch.promote_types(lg.dtype, torch.float32)), dim=-1)
        keep = t.in_vocab[tr].to(logp.dtype)
        n = keep.sum() + 1e-5
        qlogp = t.probs[tr] * logp
        cls = -(qlogp.sum(-1) * keep).sum() / n
        topk = -(qlogp.gather(-1, t.top[tr]).sum(-1) * keep).sum() / n
        loss = cls + opts.topk_weight * topk
        total = total + opts.step_weight ** (j - 1) * loss
        pred = logp.detach().argmax(-1)
        pred = vocab.to_target(pred) if vocab is not None else pred
        kept = float(keep.sum())
        metrics |= {f"loss{j}": float(loss.detach()), f"cls{j}": float(cls.detach()), f"topk{j}": float(topk.detach()),
                    f"n_loss{j}": kept, f"n_cls{j}": kept, f"n_topk{j}": kept,
                    f"acc{j}": float((pred == t.argmax[tr]).float().mean()), f"n_acc{j}": float(tr.numel())}
    metrics["loss"] = float(total.detach())
    metrics["tokens"] = int(learn.sum())
    return total, metrics


class Eagle3Objective:
    """The :class:`~selfspec.train.loop.Objective` of EAGLE-3 head training: batches of cached
    sequences (:func:`collate3`), uniform noise on the input features of training batches when
    ``noise`` > 0, and :func:`compute_losses3`."""

    plot_keys: tuple[str, ...] = ("loss", "cls1")
    eval_draws = 1  # validation passes (see loop.Objective)

    def __init__(self, target: nn.Module, opts: Eagle3Options, vocab: DraftVocab | None) -> None:
        self.target, self.opts, self.vocab = target, opts, vocab
        self.name = f"{opts.objective} (EAGLE-3)"

    def options(self) -> dict:
        return asdict(self.opts)

    def make_batch(self, seqs: list[CachedSequence], rng: random.Random) -> Batch3:
        return with_feature_noise(collate3(seqs), self.opts.noise, rng)

    def make_eval_batch(self, seqs: list[CachedSequence], rng: random.Random) -> Batch3:
        return collate3(seqs)

    def loss(self, model: nn.Module, batch: Batch3) -> tuple[torch.Tensor, dict[str, float]]:
        return compute_losses3(model, self.target, batch, self.opts, self.vocab)


def train_eagle3(target: nn.Module, seqs: Sequence[CachedSequence], out: Path, opts: Eagle3Options, meta: dict,
                 resume: bool = False, progress: bool = True, accelerator=None) -> dict:
    """Train an EAGLE-3 head on ``seqs`` (an EAGLE-3 feature cache) and save it into ``out``.

    Args:
        target: the frozen target (embedding, LM head and final norm are used).
        seqs: cached sequences with fused features and last hidden states (the last
            ``val_fraction`` are held out).
        out: output directory: the head files, ``train/`` (checkpoints, history, plot).
        opts: hyper-parameters (``feature_layers`` must be the cache's).
        meta: recorded in the head's metadata (model name, data, ...).
        resume: continue from the latest checkpoint in ``out/train/checkpoints``.
        accelerator: an ``accelerate.Accelerator`` (made here when None).

    Returns:
        the final metrics (validation per step, steps).
    """
    acc = loop.accelerator_for(target, accelerator)
    torch.manual_seed(opts.seed)
    target.requires_grad_(False)
    vocab_size = int(cast("PreTrainedConfig", target.config).vocab_size)
    reduced = 0 < opts.draft_vocab < vocab_size
    vocab = training_vocab(target, list(seqs), opts.draft_vocab) if reduced else None  # as EAGLE-2 heads'
    layers = tuple(opts.feature_layers) or None
    if opts.init:
        head, _ = load_draft_head(opts.init, target)
        if not isinstance(head, Eagle3Head):
            raise SelfspecError(f"--init head {opts.init} is an EAGLE-1/2 head; --arch eagle3 continues an EAGLE-3 "
                                "head")
        old = head.draft_vocab
        same = (old is None and vocab is None) or (old is not None and vocab is not None
                                                   and torch.equal(old.ids, vocab.ids))
        if (layers is not None and head.feature_layers != layers) or not same:
            raise SelfspecError(f"--init head {opts.init} reads layers {list(head.feature_layers)} over "
                                f"{head.lm_head.out_features} draft tokens; train with the same --feature-layers and "
                                "--draft-vocab on the same data")
    else:
        head = Eagle3Head(target, layers, vocab)
        head.init_from_target(target)
    width = seqs[0].features.shape[-1] if seqs else 0
    if width != head.fc.in_features:
        raise SelfspecError(f"the feature cache holds {width}-wide features, the EAGLE-3 head reads "
                            f"{head.fc.in_features} (three layers of the target); extract them with --arch eagle3")
    head.train()
    method = "eagle2" if opts.objective == "eagle" else "hass"
    options = recorded_options(opts)  # as recorded (resume compares it with the saved one)

    def save(model: Eagle3TTT, state: dict) -> None:
        model.head.save(out, {**meta, "method": method, "options": options, "steps": state["step"],
                              "validation": state["val"][-1] if state["val"] else {}})

    lopts = opts.loop_options()
    groups = [{"params": list(head.parameters()), "weight_decay": opts.weight_decay}]
    return loop.train(Eagle3TTT(head, opts.steps, opts.detach), Eagle3Objective(target, opts, vocab), seqs, out,
                      lopts, options, groups, save, resume=resume, progress=progress, accelerator=acc)
