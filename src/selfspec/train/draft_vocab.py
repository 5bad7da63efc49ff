"""Building a model's token ranking for reduced draft vocabularies (``selfspec-draft-vocab/1``).

Counts come from the target's own greedy answers to ShareGPT prompts (self-distillation, never
evaluation prompts; resumable through an answers cache), with a wider prior for the tokens those
answers never use: ShareGPT's own answers and Python standard-library code. The file is read by
:mod:`selfspec.models.draft_vocab`.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from tqdm.auto import tqdm

from ..core.draft_vocab import DraftVocab, ranking_from_counts
from ..models.draft_vocab import FORMAT, SIZES
from .conversations import Conversation, code_conversations, load_sharegpt
from .pipeline import regenerate

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def count_texts(tokenizer, texts: Iterable[str], vocab_size: int, progress: bool = False,
                desc: str = "") -> torch.Tensor:
    """``[V]`` int64 token counts of ``texts`` (tokenised without special tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for t in tqdm(list(texts), desc=desc or "counting", unit="text", disable=not progress):
        ids = [i for i in tokenizer(t, add_special_tokens=False)["input_ids"] if 0 <= i < vocab_size]
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
    return counts


def answers(convs: list[Conversation]) -> list[str]:
    return [text for c in convs for role, text in c.messages if role == "assistant"]


def build_ranking(model: torch.nn.Module, tokenizer, model_name: str, prompts: int = 200, max_new: int = 128,
                  prior_convs: int = 1500, prior_code: int = 100, batch: int = 16, seed: int = 42,
                  cache: Path | None = None, progress: bool = True) -> dict:
    """The ranking file's contents for one model (see module docstring).

    Args:
        prompts: ShareGPT prompts the target answers (its own generations: the counts).
        max_new: tokens per answer at most.
        prior_convs, prior_code: ShareGPT answers and stdlib files counted for the prior.
        cache: JSONL of the target's answers (appended as made; an interrupted run resumes).
    """
    from .conversations import exclude_prompts
    from .pipeline import evaluation_prompts

    vocab = int(cast("PreTrainedConfig", model.config).vocab_size)
    own_convs = exclude_prompts(load_sharegpt(prompts, seed), evaluation_prompts())
    cache = cache or Path(f"/tmp/selfspec-draft-vocab-{model_name.replace('/', '_')}.jsonl")
    cache.parent.mkdir(parents=True, exist_ok=True)
    own = regenerate(model, tokenizer, own_convs, max_new, batch, cache, progress)
    counts = count_texts(tokenizer, answers(own), vocab, progress, "counting own answers")
    prior_src = load_sharegpt(prior_convs, seed + 1) + code_conversations(prior_code, seed)
    prior = count_texts(tokenizer, answers(exclude_prompts(prior_src, evaluation_prompts())), vocab, progress,
                        "counting the prior")
    ranking = ranking_from_counts(counts, prior)
    order = torch.tensor(ranking)
    # coverage of the target's own answers by the top-N (in-sample; the sweep measures acceptance)
    coverage = {str(n): DraftVocab(order[:n], vocab).coverage(counts) for n in SIZES if n < vocab}
    return {
        "format": FORMAT, "model": model_name, "vocab_size": vocab,
        "source": {"own_answers": len(own), "own_tokens": int(counts.sum()), "max_new": max_new,
                   "prior_tokens": int(prior.sum()), "prior": f"sharegpt-answers:{prior_convs},code:{prior_code}",
                   "seed": seed},
        "coverage_own": coverage,
        "date": datetime.date.today().isoformat(),
        "ranking": ranking[: max(SIZES)],
        "counts": {str(i): int(counts[i]) for i in torch.nonzero(counts).flatten().tolist()},
    }


def write_ranking(data: dict, out: Path | str) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    head = {k: v for k, v in data.items() if k not in ("ranking", "counts")}
    # one line per big list keeps the file diffable and small
    text = json.dumps(head, indent=1)[:-2] + ',\n "ranking": ' + json.dumps(data["ranking"], separators=(",", ":"))
    text += ',\n "counts": ' + json.dumps(data["counts"], separators=(",", ":")) + "\n}\n"
    tmp.write_text(text)
    tmp.replace(out)
    return out
