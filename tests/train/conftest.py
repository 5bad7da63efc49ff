"""Fixtures shared by the training tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ..conftest import WORDS


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """32 chat conversations over the tiny tokenizer's words, with a learnable answer pattern."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("sdsat-data") / "conv.jsonl"
    with open(path, "w") as f:
        for i in range(32):
            prompt = " ".join(rng.choice(WORDS) for _ in range(5))
            answer = " ".join(WORDS[(i + j) % 12] for j in range(24))  # a learnable pattern
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": prompt},
                                                            {"role": "assistant", "content": answer}]}) + "\n")
    return path
