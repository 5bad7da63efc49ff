"""Temperatures so small that dividing logits by them overflows fp32 decode greedily."""

from __future__ import annotations

import selfspec
from selfspec.core.sampling import GREEDY_BELOW, Warper
from selfspec.models.loading import load_model

from ..conftest import prompt_ids


def test_tiny_temperature_is_greedy(tiny_dir):
    assert Warper(1e-300).greedy and Warper(GREEDY_BELOW / 2).greedy and not Warper(GREEDY_BELOW).greedy
    g = selfspec.load(load_model(str(tiny_dir)), "pld", self_test=False)
    p = prompt_ids(2, 7)
    greedy = g.generate(p, max_new_tokens=12).token_ids
    for sampling in ("coupled", "rejection"):
        assert g.generate(p, max_new_tokens=12, temperature=1e-300, seed=1, sampling=sampling).token_ids == greedy
