"""Fixtures shared by the bench tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def dataset(tmp_path) -> Path:
    """Three one-category prompts over the tiny tokenizer's words, as a bench JSONL dataset."""
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "category": "a", "prompt": f"w{i} w{i + 1} w{i + 2} w{i}", "chat": False}
            for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path
