"""``draft-model``: classic speculative decoding with a smaller model that shares the tokenizer.

The draft keeps its own KV cache. Each step it catches up on the committed tokens it has not
seen, drafts k tokens one at a time (greedy, or sampled from the warped draft distribution q,
whose rows travel with the tree for the lossless acceptance rule), and after verification rolls
its cache back to the longest prefix that is still committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from ..core import kv_cache
from ..core.acceptance import Verdict
from ..core.sampling import sample
from ..core.tree import DraftTree
from ..decoding.protocol import Budget, DrafterBase, Proposal, Sizer
from ..decoding.state import DecodeState, VerifyOutput
from ..errors import SelfspecError
from .budget import ChainBudget, ChainDraft
from .spec import AutoCandidacy, AutoContext, BuildContext, MethodSpec, chain_budget, check_numbers, need, option

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


@dataclass(frozen=True)
class DraftModelConfig:
    """Options of ``draft-model`` (each field's help is in its metadata)."""

    draft_model: str = option("", "the draft: a bundled name, directory, .gguf file or hub id of a smaller model "
                                  "with the same tokenizer (required)", flag="--draft-model")
    k: int = option(8, "the longest draft; every draft when auto_k is off (--fixed-k)", flag="--k")
    auto_k: bool = option(True, "size each draft from the measured verify-cost profile, draft cost and "
                                "acceptance, up to k: stop drafting once the product of the draft's calibrated "
                                "confidences falls below min_confidence and verify the prefix with the most expected "
                                "tokens per unit of verify cost", flag="--fixed-k", value=False)
    min_confidence: float = option(0.3, "with auto_k: the calibrated confidence product below which "
                                        "drafting stops")

    def __post_init__(self) -> None:
        check_numbers(self, "draft-model")
        if not self.draft_model:
            raise SelfspecError("method draft-model needs a draft: --draft-model NAME (e.g. "
                                "qwen2.5-coder-0.5b-instruct; API: draft_model=NAME)")
        need(self, "draft-model", "k", self.k >= 1, ">= 1")
        need(self, "draft-model", "min_confidence", 0.0 <= self.min_confidence < 1.0, "in [0, 1)")


def check_same_tokenizer(target_tok, draft_tok, target_vocab: int, draft_vocab: int, draft_name: str) -> None:
    """Refuse a draft whose tokenizer differs from the target's: its ids would mean other text."""
    same = target_tok.get_vocab() == draft_tok.get_vocab() and target_tok.eos_token_id == draft_tok.eos_token_id
    if not same:
        raise SelfspecError(
            f"draft model '{draft_name}' uses a different tokenizer than the target; "
            "choose a draft from the same model family (same vocabulary)"
        )
    if draft_vocab > target_vocab:
        raise SelfspecError(
            f"draft model '{draft_name}' has a larger output vocabulary ({draft_vocab}) than the target "
            f"({target_vocab}); choose a draft from the same model family"
        )


def _to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits ``[V_draft]`` cut or padded (with -inf) to the target's vocabulary size."""
    if logits.numel() >= vocab:
        return logits[:vocab]
    return torch.nn.functional.pad(logits, (0, vocab - logits.numel()), value=float("-inf"))


class DraftModelDrafter(DrafterBase):
    name = "draft-model"
    lossless = True
    needs_hidden = False
    request_state = ("sizer", "length")  # what adapts across requests (LearnedState.snapshot / restore)
    sizer: Sizer | None  # the Drafter protocol's member, set in __init__

    def __init__(self, draft: torch.nn.Module, target_vocab: int, sizer: ChainBudget,
                 min_confidence: float = 0.0) -> None:
        """
        Args:
            draft: a stock HF causal LM on the same device as the target.
            target_vocab: the target's logits width V; q rows are padded to it.
            sizer: picks the draft length each step (and the verified prefix); fed by the controller.
            min_confidence: stop drafting when the product of draft confidences falls below it.
        """
        self.draft = draft
        self.draft_model = draft  # what bench's hf-assisted peer can reuse (registry.draft_model_of)
        self.min_confidence = min_confidence
        self.target_vocab = target_vocab
        self.sizer = sizer
        self.device = next(draft.parameters()).device
        self.cache = kv_cache.new_cache(draft.config)
        self.length = 0  # committed tokens whose KV the draft cache holds

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        """Run the draft over the prompt now, so each step only catches up on a few tokens and
        the measured per-token draft cost (which sizes the drafts) is not inflated by it."""
        self.cache = kv_cache.new_cache(self.draft.config)
        self.length = 0
        self._forward(state.ids[:-1])

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` after the draft cache; returns the last position's logits ``[V_d]``."""
        t = torch.tensor(ids, dtype=torch.long, device=self.device)[None]
        pos = torch.arange(self.length, self.length + len(ids), device=self.device)[None]
        out = self.draft(input_ids=t, position_ids=pos, **kv_cache.cache_arg(self.draft, self.cache), use_cache=True,
                         logits_to_keep=1)
        self.length += len(ids)
        return out.logits[0, -1].float()

    def propose(self, state: DecodeState, budget: Budget[ChainBudget, ChainDraft] | None) -> Proposal:
        assert budget is not None  # the controller's: this drafter has a sizer
        sizer = budget.sizer
        k = sizer.choose(state.draft_room)
        if k == 0:
            return Proposal(DraftTree.chain([state.pending]))
        logits = self._forward(state.ids[self.length :])
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        confidences: list[float] = []
        p_all = 1.0
        for i in range(k):
            if state.deterministic:  # greedy, or coupled: the same Gumbel noise as the target's
                if logits.numel() != self.target_vocab:
                    logits = _to_vocab(logits, self.target_vocab)
                probs = state.scores(logits, state.draft_index(i + 1)).softmax(-1)
                x = int(probs.argmax())
                conf = float(probs[x])
            else:
                q = state.warper.probs(logits)
                if q.numel() < self.target_vocab:
                    q = torch.nn.functional.pad(q, (0, self.target_vocab - q.numel()))
                x = sample(q, state.generator)
                conf = float(q[x])
                qs.append(q)
            tokens.append(x)
            confidences.append(conf)
            p_all *= sizer.calibration(conf)
            if i < k - 1 and p_all >= self.min_confidence:
                logits = self._forward([x])
            else:
                break
        made = ChainDraft(len(tokens), tuple(confidences))  # what the sizer learns the draft's cost from
        keep = sizer.best_prefix(confidences)
        tokens, qs = tokens[:keep], qs[:keep]
        draft_probs = None
        if qs and tokens:
            draft_probs = torch.stack([torch.zeros_like(qs[0]), *qs])
        budget.made = made
        return Proposal(DraftTree.chain([state.pending, *tokens], draft_probs))

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        # the draft cache is valid up to the last committed token that it saw
        self.length = min(self.length, len(state.ids) - 1)
        kv_cache.truncate(self.cache, self.length)


def build(spec: MethodSpec, target, cfg: DraftModelConfig, ctx: BuildContext) -> DraftModelDrafter:
    from ..models.loading import load_model

    draft = load_model(cfg.draft_model, cast(torch.device, ctx.device), cast(torch.dtype, ctx.dtype),
                       ctx.trust_remote_code, kernels=ctx.kernels, release_fp32=True)  # the target's device, dtype
    check_same_tokenizer(target.tokenizer, draft.tokenizer, target.model.config.vocab_size,
                         cast("PreTrainedConfig", draft.model.config).vocab_size, cfg.draft_model)
    budget = chain_budget(target, cfg.auto_k, cfg.k, ctx.measure)
    return DraftModelDrafter(draft.model, target.model.config.vocab_size, budget,
                             cfg.min_confidence if cfg.auto_k else 0.0)


def _named_draft(name: str, target, ctx: AutoContext) -> dict | None:
    return {"draft_model": ctx.draft_model} if ctx.draft_model else None


SPEC = MethodSpec("draft-model", DraftModelConfig, build, True,
                  "a smaller model with the same tokenizer drafts (--draft-model)",
                  auto=AutoCandidacy(_named_draft), draft_weights=True)  # a candidate where the user names a draft
