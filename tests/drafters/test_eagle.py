"""EAGLE-2 tree construction: rerank invariants, path scores equal sequential draft log-probs,
the expansion masks, the tree-size rule, and the head's stable cache after decoding."""

from __future__ import annotations

import math

import pytest
import torch

import selfspec
from selfspec.core import kv_cache
from selfspec.core.cost import CostProfile
from selfspec.drafters.eagle import Pool, best_size, rerank
from selfspec.models.loading import load_model

from ..conftest import prompt_ids


def test_rerank_builds_a_parent_closed_tree_with_ancestor_masks():
    # root children 0,1 ; 0's children 2,3 ; 1's children 4,5 ; 2's children 6,7
    scores = torch.tensor([-0.1, -0.5, -0.3, -2.0, -0.9, -0.6, -0.35, -3.0])
    parents = torch.tensor([-1, -1, 0, 0, 1, 1, 2, 2])
    tokens = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    tree, idx = rerank(Pool(scores, tokens, parents), pending=99, n=5)
    assert idx.tolist() == [0, 1, 2, 5, 6]  # the 5 best, in pool order
    assert tree.token_list == [99, 10, 11, 12, 15, 16]
    assert tree.parent_list == [-1, 0, 0, 1, 2, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]
    m = tree.ancestor_mask
    assert m[:, 0].all() and m[5].tolist() == [True, True, False, True, False, True]
    assert sorted(len(p) for p in tree.paths) == [3, 4]


def test_rerank_ties_rank_ancestors_first_and_closure_is_asserted():
    scores = torch.tensor([-1.0, -1.0, -1.0])  # a child tying its parent: the parent (lower index) wins
    tree, _ = rerank(Pool(scores, torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 1])), 1, n=2)
    assert tree.parent_list == [-1, 0, 1]
    bad = Pool(torch.tensor([-2.0, -1.0]), torch.tensor([5, 6]), torch.tensor([-1, 0]))  # child above parent
    with pytest.raises(AssertionError, match="parent"):
        rerank(bad, 1, n=1)


class HostReads(torch.Tensor):
    """A tensor that counts the reads that move its values to the host (a sync on a GPU):
    ``item``, ``tolist``, ``float``/``int``/``bool``, and copies to the CPU (``.cpu()``/``.to``).
    Results of torch operations on it stay counted tensors (``__torch_function__``); a copy on the
    host is a plain tensor again (reading it costs nothing more)."""

    reads: list[str] = []
    HOST = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in cls.HOST:
            cls.reads.append(name)
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if name in ("cpu", "numpy") else out


def test_rerank_moves_the_pool_to_the_host_once():
    """No host sync per pool node (issue 34): ranking and the parent remap are tensor operations;
    the chosen nodes and the closure check's flags cross to the host in one transfer."""
    g = torch.Generator().manual_seed(0)
    p = 60
    parents = torch.tensor([-1] * 6 + [int(torch.randint(0, i, (), generator=g)) for i in range(6, p)])
    scores = torch.zeros(p)
    for i in range(p):  # a child never scores above its parent
        scores[i] = (scores[parents[i]] if parents[i] >= 0 else 0.0) - float(torch.rand((), generator=g))
    pool = Pool(scores.as_subclass(HostReads), torch.arange(100, 100 + p).as_subclass(HostReads),
                parents.as_subclass(HostReads))
    HostReads.reads = []
    tree, idx = rerank(pool, pending=1, n=25)
    assert tree.size == 26 and HostReads.reads == ["cpu"], HostReads.reads  # was one float() per pool node
    plain, plain_idx = rerank(Pool(scores, torch.arange(100, 100 + p), parents), pending=1, n=25)
    assert plain.token_list == tree.token_list and plain.parent_list == tree.parent_list
    order = sorted(range(p), key=lambda i: (-float(scores[i]), i))  # the definition: best n, ties by index
    assert plain_idx.tolist() == sorted(order[:25])


def test_best_size_follows_the_cost_profile():
    probs = torch.tensor([0.9, 0.8, 0.5, 0.05, 0.01])
    flat = CostProfile(qs=(1, 2, 4, 8), seconds=(1.0, 1.0, 1.0, 1.0), key="t", context=0)
    steep = CostProfile(qs=(1, 2, 4, 8), seconds=(1.0, 2.0, 4.0, 8.0), key="t", context=0)
    assert best_size(probs, 0.1, flat, 64) == 5  # verification is free: take everything
    assert best_size(probs, 0.1, steep, 64) == 0  # each node costs a full forward: not worth it
    assert best_size(probs, 0.1, None, 4) == 3


@pytest.fixture(scope="module")
def generator(tiny_dir):
    t = load_model(str(tiny_dir))
    t.model.double()
    return selfspec.load(t, "hass", head="random:3", total_tokens=9, top_k=3, depth=3, min_prob=0.0,
                         self_test=False)


def test_pool_scores_are_sequential_draft_log_probs(generator):
    d = generator.drafter
    ids = prompt_ids(5, 11)
    target = generator.target.model
    with torch.no_grad():
        feats = target.model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
    d.cache, d.length, d.features = kv_cache.new_cache(d.head.config), 0, feats.to(d.dtype)
    h_last = d.catch_up(ids)
    pool = d.expand(h_last, d.length)
    kv_cache.truncate(d.cache, d.length)
    stable = kv_cache.cache_length(d.cache)
    assert stable == len(ids) - 1
    lm, emb = d.lm_head, d.embed
    for i in range(pool.scores.numel()):
        chain = [i]
        while int(pool.parents[chain[-1]]) >= 0:
            chain.append(int(pool.parents[chain[-1]]))
        chain.reverse()
        # sequential: each node's parent output and token, one position after another
        h, total = h_last, 0.0
        for depth, node in enumerate(chain):
            lp = torch.log_softmax(lm(h[None]).double(), -1)[0]
            tok = int(pool.tokens[node])
            total += float(lp[tok])
            if depth + 1 < len(chain):
                pos = stable + depth
                mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
                h = d.head(h[None, None], emb(torch.tensor([[tok]])).double(), torch.tensor([[pos]]), mask,
                           d.cache)[0, 0]
        kv_cache.truncate(d.cache, stable)
        assert math.isclose(total, float(pool.scores[i]), rel_tol=1e-9, abs_tol=1e-9), i


def test_stable_cache_equals_a_from_scratch_head_forward(generator):
    d = generator.drafter
    ids = prompt_ids(7, 9)
    r = generator.generate(ids, max_new_tokens=12)
    full = ids + r.token_ids  # the last one is pending (committed text, no feature yet)
    n = d.length
    assert 0 < n <= len(full) - 2  # what the last proposal had encoded (its verify committed more)
    with torch.no_grad():
        feats = generator.target.model.model(input_ids=torch.tensor([full[: n]])).last_hidden_state
        cache = kv_cache.new_cache(d.head.config)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        d.head(feats, d.embed(torch.tensor([full[1 : n + 1]])).double(), torch.arange(n)[None], mask, cache)
    got, want = d.cache.layers[0], cache.layers[0]
    assert torch.allclose(got.keys[..., :n, :], want.keys, atol=1e-9)
    assert torch.allclose(got.values[..., :n, :], want.values, atol=1e-9)


def test_backoff_stops_drafting_when_it_does_not_pay_and_probes():
    from selfspec.drafters.backoff import Backoff

    b = Backoff(t1=1.0)
    for _ in range(4):  # 1.5 tokens per 2 s: slower than ar (1 token/s)
        assert b.draft_now()
        b.record(1, 2.0) if _ % 2 else b.record(2, 2.0)
    assert b.off
    pattern = [b.draft_now() for _ in range(8)]
    assert pattern == [False] * 7 + [True]  # a probe after 8 steps: a burst of 4 drafted steps
    for _ in range(3):
        b.record(1, 2.0)
        assert b.draft_now()  # the burst goes on, however its steps look
    b.record(1, 2.0)  # still does not pay: the interval doubles
    assert b.off and b.probe_every == 16
    for _ in range(15):
        assert not b.draft_now()
    assert b.draft_now()
    for _ in range(4):
        b.record(6, 1.0)  # now drafts pay: drafting resumes at the end of the burst
    assert not b.off and b.draft_now() and b.probe_every == 8
    never = Backoff(t1=None)
    never.record(1, 100.0)
    assert never.draft_now()


def test_backoff_decides_on_runs_of_steps_and_clips_spikes():
    from selfspec.drafters.backoff import Backoff

    b = Backoff(t1=1.0, min_steps=4)
    b.record_plain(1.0)
    for _ in range(3):
        b.record(2, 1.5)  # 1.33 tokens/s: pays
    b.record(1, 30.0)  # a 30 s spike counts as 3 plain steps: 7 tokens in 7.5 s... still under 1/s
    assert b.off
    b = Backoff(t1=1.0, min_steps=4)
    b.record_plain(1.0)
    for _ in range(4):
        b.record(3, 1.5)
    b.record(1, 30.0)  # unclipped, 30 s would switch drafting off; clipped it does not
    assert not b.off
    # once switched back on after a probe, one bad step does not switch it off again
    c = Backoff(t1=1.0, min_steps=4)
    c.record_plain(1.0)
    for _ in range(4):
        c.record(1, 2.0)
    assert c.off
    while not c.draft_now():
        pass
    for _ in range(4):
        c.record(4, 1.2)
    assert not c.off
    c.record(1, 2.0)
    assert not c.off  # 1 of the 4 steps a decision needs since drafting resumed


def test_best_size_uses_the_calibrated_acceptance():
    from selfspec.drafters.estimators import ConfidenceCalibration

    probs = torch.tensor([0.35, 0.32, 0.31, 0.3])
    profile = CostProfile((1, 2, 5), (0.1, 0.15, 0.3), 256, "k")
    assert best_size(probs, 0.02, profile, 64) == 0  # at face value the nodes do not pay
    cal = ConfidenceCalibration()
    for _ in range(60):  # nodes of path probability 0.3-0.4 turn out to be accepted
        cal.observe_one(0.33, True)
    assert best_size(probs, 0.02, profile, 64, cal) == 4
    for _ in range(200):  # and then they stop being accepted
        cal.observe_one(0.33, False)
    assert best_size(probs, 0.02, profile, 64, cal) == 0


def test_backoff_compares_with_measured_plain_steps():
    from selfspec.drafters.backoff import Backoff

    b = Backoff(t1=0.1, min_steps=2)
    for _ in range(3):  # 2 tokens in 0.25 s: slower than the bare T(1) of the profile
        b.record(2, 0.25)
    assert b.off
    for _ in range(5):  # but a plain step of the loop takes 0.15 s, not 0.1
        b.record_plain(0.15)
    b.record(2, 0.25)  # the next probe: 8 tokens/s beats 6.7
    assert not b.off and b.draft_now()
    slow = Backoff(t1=0.1, min_steps=2)
    slow.record_plain(0.11)
    for _ in range(3):
        slow.record(2, 0.25)
    assert slow.off  # against a measured 0.11 s plain step drafting does not pay
