"""``selfspec train hass``: data -> (self-distillation) -> cached features -> head training.

Every stage writes into the output directory and resumes: ``data/examples.pt`` (tokenised
training examples), ``features/`` (target features, shard by shard), ``train/checkpoints``.
Several heads (the EAGLE vs HASS ablation) share one feature directory via ``features_dir``.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from tqdm import tqdm

from ..errors import SelfspecError
from .conversations import (
    Conversation,
    Example,
    build_examples,
    code_conversations,
    exclude_prompts,
    load_jsonl_conversations,
    load_sharegpt,
)

if TYPE_CHECKING:
    from transformers import GenerationMixin

log = logging.getLogger(__name__)
KEEP = "keep:"  # id prefix of conversations whose answers are never regenerated


@dataclass(frozen=True)
class DataOptions:
    """What to train on.

    Attributes:
        data: comma-separated sources: ``sharegpt[:N]`` (ShareGPT V3 from PyPI; answers
            regenerated when ``regenerate`` > 0), ``sharegpt-answers[:N]`` (N other ShareGPT
            conversations whose answers are always kept), ``code[:N]``
            (Python standard library modules), or a JSONL file of conversations.
        max_len: tokens per example at most.
        regenerate: replace the assistant turns of the ShareGPT conversations by the target's own
            greedy answer to their first user turn, at most this many tokens (0 = keep the
            ShareGPT answers). Self-distillation: the head then learns the target's own text.
        regenerate_batch: prompts generated together.
        seed: shuffling.
    """

    data: str = "sharegpt:224,sharegpt-answers:300,code:60"
    max_len: int = 512
    regenerate: int = 0
    regenerate_batch: int = 16
    seed: int = 42


def evaluation_prompts() -> list[str]:
    """Texts that must never be trained on: built-in prompts, MT-bench (if available), HumanEval."""
    from ..bench import datasets

    texts = [p.text for p in datasets.builtin()]
    for name, loader in (("MT-bench", datasets.mt_bench), ("HumanEval", datasets.humaneval)):
        try:
            for p in loader():
                texts.extend(p.turns or (p.text,))
        except SelfspecError as e:  # offline, or a package missing: say so, the data may then hold them
            log.warning("%s prompts are not excluded from the training data (%s)", name,
                        str(e).rstrip("."))
    return texts


SOURCES = ("sharegpt", "sharegpt-answers", "code")  # the built-in --data sources (NAME[:N])


def _data_parts(spec: str) -> list[tuple[str, str, int | None]]:
    """``(entry, source name or "file", count)`` of each comma-separated ``--data`` entry, checked:
    a count that is not an integer, a file that does not exist or an unknown name is a one-line
    error (nothing is read)."""
    parts: list[tuple[str, str, int | None]] = []
    for part in (s.strip() for s in spec.split(",") if s.strip()):
        name, _, num = part.partition(":")
        if name not in SOURCES:
            if Path(part).is_file():
                parts.append((part, "file", None))
                continue
            if Path(part).is_dir():
                raise SelfspecError(f"--data {part} is a directory; pass a JSONL file of conversations")
            if "/" in part or "\\" in part or part.endswith((".jsonl", ".json")):
                raise SelfspecError(f"--data file {part} not found")
            raise SelfspecError(f"--data entry {part!r} is neither {', '.join(f'{n}[:N]' for n in SOURCES)} "
                                "nor a JSONL file")
        try:
            limit = int(num) if num else None
        except ValueError as e:
            raise SelfspecError(f"--data entry {part!r}: the count after ':' must be an integer") from e
        parts.append((part, name, limit))
    if not parts:
        raise SelfspecError("--data names no source; pass e.g. code:60 or a JSONL file")
    return parts


def check_data_spec(spec: str) -> None:
    """Check a ``--data`` spec without reading any data (before a model loads)."""
    _data_parts(spec)


def load_conversations(spec: str, seed: int) -> list[Conversation]:
    """Conversations of a ``--data`` spec (see :class:`DataOptions`), evaluation prompts removed."""
    out: list[Conversation] = []
    for part, name, limit in _data_parts(spec):
        if name == "sharegpt":
            out += load_sharegpt(limit, seed)
        elif name == "sharegpt-answers":  # other conversations (another shuffle), ShareGPT's answers kept
            out += [Conversation(f"{KEEP}{c.id}", c.messages) for c in load_sharegpt(limit, seed + 1)]
        elif name == "code":
            out += code_conversations(limit, seed)
        else:
            out += load_jsonl_conversations(part)
    if not out:
        raise SelfspecError("--data gave no conversations")
    return exclude_prompts(out, evaluation_prompts())


def _prompt_text(tokenizer, user: str) -> str:
    """The generation prompt for one user turn: the chat template, or the plain-text format of
    :mod:`.conversations` when the tokenizer has none."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
    return f"User: {user}\nAssistant:"


@torch.inference_mode()
def regenerate(model: torch.nn.Module, tokenizer, convs: list[Conversation], max_new: int, batch: int,
               cache: Path, progress: bool = True) -> list[Conversation]:
    """Replace each conversation by (first user turn, the target's greedy answer).

    Answers are appended to ``cache`` (JSONL) as they are made, so an interrupted run resumes.
    Code conversations (id prefix ``stdlib:``) and ``sharegpt-answers`` ones are kept as they are.
    """
    done: dict[str, str] = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            r = json.loads(line)
            done[r["id"]] = r["answer"]
    todo = [c for c in convs if not c.id.startswith(("stdlib:", KEEP)) and c.id not in done]
    todo.sort(key=lambda c: len(c.messages[0][1]))  # similar lengths batch together: less padding
    device = next(model.parameters()).device
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"  # restored below: the tokenizer is shared with the caller
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    bar = tqdm(total=len(todo), desc="self-distillation", unit="conv", disable=not progress, file=sys.stderr)
    with open(cache, "a") as f:
        for i in range(0, len(todo), batch):
            chunk = todo[i : i + batch]
            texts = [_prompt_text(tokenizer, c.messages[0][1][:2000]) for c in chunk]
            enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=384,
                            add_special_tokens=False).to(device)
            gen = cast("GenerationMixin", model).generate(**enc, max_new_tokens=max_new, do_sample=False,
                                                          pad_token_id=tokenizer.pad_token_id)
            for c, row in zip(chunk, gen[:, enc["input_ids"].shape[1] :]):
                ans = tokenizer.decode(row, skip_special_tokens=True).strip()
                done[c.id] = ans
                f.write(json.dumps({"id": c.id, "answer": ans}) + "\n")
            f.flush()
            bar.update(len(chunk))
    bar.close()
    tokenizer.padding_side, tokenizer.pad_token = side, pad
    out = []
    for c in convs:
        if c.id.startswith(("stdlib:", KEEP)):
            out.append(c)
        elif done.get(c.id):
            out.append(Conversation(c.id, (c.messages[0], ("assistant", done[c.id]))))
    return out


def prepare_examples(model: torch.nn.Module, tokenizer, opts: DataOptions, out: Path, progress: bool = True
                     ) -> list[Example]:
    """Tokenised examples (cached in ``out/examples.pt``; remade when the options differ)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "examples.pt"
    key = json.dumps(opts.__dict__, sort_keys=True)
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        if saved.get("key") == key:
            return saved["examples"]
    convs = load_conversations(opts.data, opts.seed)
    if opts.regenerate:
        convs = regenerate(model, tokenizer, convs, opts.regenerate, opts.regenerate_batch, out / "answers.jsonl",
                           progress)
    examples = build_examples(tokenizer, convs, opts.max_len, progress)
    if not examples:
        raise SelfspecError("no training example has tokens to learn (assistant text) after tokenisation")
    torch.save({"key": key, "examples": examples}, path)
    return examples
