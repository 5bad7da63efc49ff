"""Ahead noise: copies of earlier tokens only, in order, reproducible from the generator."""

from __future__ import annotations

import pytest
import torch

from selfspec.core.ahead_noise import ahead_noise, noise_span


def test_decode_noise_comes_from_the_text():
    ids = [7, 8, 9]
    out = ahead_noise(ids, 50, torch.Generator().manual_seed(0))
    assert len(out) == 50 and set(out) == {7, 8, 9}  # uniform over positions: all of them appear
    assert out == ahead_noise(ids, 50, torch.Generator().manual_seed(0))
    assert ahead_noise(ids, 0, torch.Generator()) == []
    with pytest.raises(ValueError):
        ahead_noise([], 1, torch.Generator())


def test_span_copies_only_earlier_positions():
    """Distinct tokens make every copy traceable: position i holds a token from positions < i
    (possibly an earlier noised one), positions outside the span are untouched."""
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        ids = torch.arange(100, 120)
        out = noise_span(ids.clone(), 10, 4, g)
        assert torch.equal(out[:10], torch.arange(100, 110)) and torch.equal(out[14:], torch.arange(114, 120))
        for i in range(10, 14):
            assert 100 <= int(out[i]) < 100 + i
    with pytest.raises(ValueError):
        noise_span(torch.arange(5), 0, 2, g)
    assert torch.equal(noise_span(torch.arange(5), 4, 3, torch.Generator().manual_seed(0))[:4], torch.arange(4))
