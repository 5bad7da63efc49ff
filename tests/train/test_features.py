"""The feature cache: its progress bar counts only what is extracted now."""

from __future__ import annotations

import re

import torch

from selfspec.train.conversations import Example
from selfspec.train.features import extract_features

from ..conftest import tiny_model


def test_cached_shards_do_not_count_as_speed(tmp_path, capsys):
    """A resumed extraction put the cached tokens into the bar's rate: '57,019,862 tok/s'."""
    model = tiny_model()
    examples = [Example(f"e{i}", torch.arange(4, 20 + i), torch.ones(16 + i, dtype=torch.bool)) for i in range(6)]
    extract_features(model, examples, tmp_path, {"model": "tiny"}, shard_examples=2)
    capsys.readouterr()
    extract_features(model, examples, tmp_path, {"model": "tiny"}, shard_examples=2)  # every shard cached
    bar = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"features: 100%.*\?tok/s", bar), bar  # nothing extracted: no rate
