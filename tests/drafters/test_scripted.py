"""The scripted oracle drafter with a set acceptance probability (``accept_prob``): lossless, and
its drafts are accepted at the rate it was given (what ``scripts/gpu_check.py`` relies on)."""

from __future__ import annotations

import pytest

import selfspec
from selfspec.drafters.scripted import ScriptedDrafter
from selfspec.models.loading import load_model

from ..conftest import TEST_DEVICE, VOCAB, prompt_ids

K = 4
MAX_NEW = 60


@pytest.fixture(scope="module")
def setup(tiny_dir):
    target = load_model(str(tiny_dir), device=TEST_DEVICE, kernels="stock")
    g = selfspec.load(target, "ar", self_test=False)
    prompt = prompt_ids(11, 9)
    ref = g.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True).token_ids
    return g, prompt, ref


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("p", [0.0, 0.5, 0.8, 1.0])
def test_accept_prob_is_lossless_and_accepts_at_its_rate(setup, p, tree):
    g, prompt, ref = setup
    accepted = drafted = 0
    for seed in range(4):
        g.drafter = ScriptedDrafter(ref, K, 0, VOCAB, tree=tree, accept_prob=p, seed=seed)
        r = g.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
        assert r.token_ids == ref
        for c, d in zip(r.committed_per_step[1:-1], r.drafted_per_step[1:-1]):  # the last step may be cut
            accepted += c - 1
            drafted += d
    # tokens accepted per drafted token: sum_{i<K} p^(i+1) / K for a chain of K right with prob p each
    expected = sum(p ** (i + 1) for i in range(K)) / K
    assert abs(accepted / drafted - expected) < 0.12, (accepted / drafted, expected)


def test_same_seed_same_draws(setup):
    g, prompt, ref = setup
    runs = []
    for _ in range(2):
        g.drafter = ScriptedDrafter(ref, K, 0, VOCAB, accept_prob=0.6, seed=3)
        runs.append(g.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True).committed_per_step)
    assert runs[0] == runs[1]


def test_accept_prob_out_of_range_is_refused():
    with pytest.raises(ValueError, match="accept_prob"):
        ScriptedDrafter([1, 2], K, 0, VOCAB, accept_prob=1.5)
