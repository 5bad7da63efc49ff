"""Where a model's token ranking for reduced draft vocabularies is found, and the subset a drafter uses.

A ranking file (``selfspec-draft-vocab/1``, written by ``scripts/build_draft_vocab.py`` /
:func:`selfspec.train.draft_vocab.build_ranking`) lists every token id of one model, most frequent
first in the target's own generations, with the counts it was built from. Found in this order:
``$SELFSPEC_HOME/draft_vocab/<model>.json`` (yours), then ``selfspec/data/draft_vocab/<model>.json``
(shipped). See :mod:`selfspec.core.draft_vocab` for why drafting over a subset stays lossless.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from ..core.draft_vocab import DraftVocab
from ..errors import SelfspecError
from ..paths import model_key, selfspec_home

FORMAT = "selfspec-draft-vocab/1"
SIZES = (2048, 4096, 8192, 16384, 32768)  # the sizes measured by experiments/draft_vocab_sweep.py


def user_ranking_path(model_name: str) -> Path:
    return selfspec_home() / "draft_vocab" / f"{model_key(model_name)}.json"


def shipped_ranking_path(model_name: str) -> Path | None:
    p = resources.files("selfspec") / "data" / "draft_vocab" / f"{model_key(model_name)}.json"
    return Path(str(p)) if p.is_file() else None


def read_ranking(path: Path | str, vocab_size: int) -> dict:
    """A ranking file's contents; one-line errors for a foreign or corrupt file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SelfspecError(f"draft vocabulary ranking {path} cannot be read ({e}); rebuild it with "
                            "scripts/build_draft_vocab.py") from e
    if data.get("format") != FORMAT:
        raise SelfspecError(f"{path} is not a selfspec draft vocabulary ranking (format {data.get('format')!r})")
    if int(data.get("vocab_size", -1)) != vocab_size:
        raise SelfspecError(f"draft vocabulary ranking {path} is for a vocabulary of {data.get('vocab_size')} "
                            f"tokens, the model has {vocab_size}; rebuild it for this model")
    return data


def find_ranking(model_name: str, vocab_size: int) -> tuple[dict, str] | None:
    """``(ranking file contents, path)`` of the model, or None when it has none."""
    for p in (user_ranking_path(model_name), shipped_ranking_path(model_name)):
        if p is not None and p.is_file():
            return read_ranking(p, vocab_size), str(p)
    return None


def always_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """Tokens every draft vocabulary holds: EOS ids of the model and the tokenizer's special
    tokens (the chat template's turn markers and end tokens among them)."""
    out: set[int] = set()
    gc = getattr(model, "generation_config", None)
    for eos in (getattr(gc, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if isinstance(eos, int):
            out.add(eos)
        elif eos:
            out.update(int(e) for e in eos)
    if tokenizer is not None:
        out.update(int(t) for t in getattr(tokenizer, "all_special_ids", []) or [])
    return sorted(out)


def draft_vocab_for(target, size: int) -> DraftVocab | None:
    """The reduced draft vocabulary of ``size`` tokens for a loaded target (``LoadedModel``), or
    None for the full vocabulary (``size`` 0, or not smaller than the vocabulary).

    Raises:
        SelfspecError: a size was asked for but the model has no ranking.
    """
    vocab = int(target.model.config.vocab_size)
    if size <= 0 or size >= vocab:
        return None
    found = find_ranking(target.name, vocab)
    if found is None:
        raise SelfspecError(
            f"no draft vocabulary ranking for model '{target.name}': build one with "
            f"`python scripts/build_draft_vocab.py --model {target.name}`, or pass draft_vocab=0 (--draft-vocab 0) "
            "for the full vocabulary")
    data, _ = found
    return DraftVocab.from_ranking(data["ranking"], size, vocab, always_ids(target.model, target.tokenizer))
