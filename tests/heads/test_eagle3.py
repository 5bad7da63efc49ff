"""EAGLE-3 heads (``heads/eagle3.py``) and their drafting: the layout and files, training-time test
== drafting at inference (fp64), the drafter's feature bookkeeping and scores with the head's own
LM head, and greedy ids identical to ``transformers`` ``generate`` with random EAGLE-3 heads (full
and reduced draft vocabularies, Llama and Qwen2 targets). The trained-head end to end (train ->
decode -> export) is in ``tests/train/test_eagle3_train.py``; the exports in ``test_export.py``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import selfspec
from selfspec.core import kv_cache
from selfspec.core.draft_vocab import DraftVocab
from selfspec.drafters.eagle_heads import HeadLMHead
from selfspec.errors import SelfspecError
from selfspec.heads.checkpoints import load_draft_head
from selfspec.heads.eagle import EagleHead, load_head
from selfspec.heads.eagle3 import (
    Eagle3Head,
    default_feature_layers,
    resolve_feature_layers,
    target_features,
)
from selfspec.models.loading import load_model
from selfspec.train.eagle3 import Eagle3TTT, ttt_mask

from ..conftest import VOCAB, prompt_ids, tiny_model
from ..decoding.test_greedy_equivalence import InvariantChecker, hf_greedy

L = 9


def perturbed(head: Eagle3Head, scale: float = 0.2) -> Eagle3Head:
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * scale)
    return head


@pytest.fixture(scope="module")
def setup():
    """A 5-layer fp64 target, a random EAGLE-3 head over a reduced vocabulary, fused features."""
    torch.manual_seed(0)
    target = tiny_model("llama", seed=2, layers=5).double()
    vocab = DraftVocab(list(range(0, VOCAB, 3)), VOCAB)
    head = perturbed(Eagle3Head(target, (1, 3, 4), draft_vocab=vocab)).double()
    tokens = torch.randint(4, 90, (1, L + 1))
    with torch.no_grad():
        hidden = target.model(input_ids=tokens[:, :L], output_hidden_states=True).hidden_states
        emb = target.get_input_embeddings()(tokens[:, 1:]).double()  # x_1 .. x_L
    feats = head.select_features(hidden)
    return target, head, feats, emb


def test_layout_files_and_loading(setup, tmp_path):
    target, head, feats, emb = setup
    h = target.config.hidden_size
    assert head.feature_layers == (1, 3, 4) and default_feature_layers(5) == (2, 2, 2)
    assert default_feature_layers(32) == (2, 16, 29) and default_feature_layers(3) == (0, 1, 2)
    assert resolve_feature_layers(5, [1, 2, 4]) == (1, 2, 4)
    for bad in ([1, 2], [0, 1, 5], [-1, 0, 1]):
        with pytest.raises(SelfspecError, match="three hidden-state indices"):
            resolve_feature_layers(5, bad)
    head.save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    n = head.draft_vocab.size
    assert shapes["fc.weight"] == (h, 3 * h) and "fc.bias" not in shapes
    assert shapes["midlayer.self_attn.q_proj.weight"] == (64, 2 * h)
    assert shapes["midlayer.self_attn.k_proj.weight"] == shapes["midlayer.self_attn.v_proj.weight"] == (32, 2 * h)
    assert {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight"} <= set(shapes)
    assert shapes["lm_head.weight"] == (n, h) and shapes["d2t"] == (n,) and shapes["t2d"] == (VOCAB,)
    assert not any(k.startswith("layers.") or "embed" in k for k in shapes)
    meta = json.loads((tmp_path / "h" / "selfspec_head.json").read_text())
    assert meta["head_arch"] == "eagle3" and meta["feature_layers"] == list(head.feature_layers)
    assert meta["draft_vocab_size"] == n
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == n and cfg["target_hidden_size"] == h and cfg["num_hidden_layers"] == 1

    loaded, _ = load_draft_head(tmp_path / "h", target)
    assert isinstance(loaded, Eagle3Head) and torch.equal(loaded.draft_vocab.ids, head.draft_vocab.ids)
    mask = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        a = head.logits(head(feats, emb, torch.arange(L)[None], mask))
        b = loaded.double().logits(loaded(feats, emb, torch.arange(L)[None], mask))
    assert torch.equal(a, b)
    with pytest.raises(SelfspecError, match="is an eagle3 head") as e:
        load_head(tmp_path / "h", target)  # the EAGLE-1/2 loader says where to go
    assert "\n" not in str(e.value)
    other = tiny_model("llama", seed=2, layers=5, vocab=VOCAB + 4)
    with pytest.raises(SelfspecError, match="another architecture"):
        load_draft_head(tmp_path / "h", other)
    # an EAGLE-1/2 head still loads through the dispatcher
    EagleHead(target).save(tmp_path / "e2", {"target": "tiny", "method": "hass"})
    assert isinstance(load_draft_head(tmp_path / "e2", target)[0], EagleHead)


def test_own_outputs_skip_fc_and_target_features(setup):
    target, head, feats, emb = setup
    x = head.project(feats, emb)
    assert x.shape[-1] == 2 * head.hidden_size
    assert torch.equal(x[..., head.hidden_size:], head.fc(feats))
    own = torch.randn(1, L, head.hidden_size, dtype=torch.float64)
    assert torch.equal(head.project(own, emb)[..., head.hidden_size:], own)
    with pytest.raises(ValueError, match="width"):
        head.project(torch.zeros(1, L, 7, dtype=torch.float64), emb)
    hidden = tuple(torch.randn(L, 64) for _ in range(6))
    rows = torch.tensor([1, 4])
    want = torch.cat([hidden[i][rows] for i in head.feature_layers], -1)
    assert torch.equal(target_features(head, hidden, rows), want)
    assert torch.equal(target_features(EagleHead(target), hidden, rows), hidden[-1][rows])


def chained(head: Eagle3Head, feats: torch.Tensor, emb: torch.Tensor, t: int, steps: int) -> list[torch.Tensor]:
    """Inference drafting: fused features F_0..F_t into a fresh cache, then feed the head's own
    output back ``steps - 1`` times (ground-truth tokens)."""
    cache = kv_cache.new_cache(head.config)
    n = t + 1
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    out = head(feats[:, :n], emb[:, :n], torch.arange(n)[None], mask, cache)[:, -1]
    outs = [out]
    for s in range(1, steps):
        pos = t + s
        mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
        out = head(out[:, None], emb[:, pos : pos + 1], torch.tensor([[pos]]), mask, cache)[:, -1]
        outs.append(out)
    return outs


def test_ttt_mask():
    m = ttt_mask(4, 2)
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    eye = torch.eye(4, dtype=torch.bool)
    assert torch.equal(m[:, 4:8], eye) and torch.equal(m[:, 8:], eye)


@torch.no_grad()
@pytest.mark.parametrize("detach", [False, True])
def test_training_time_test_step_j_equals_j_step_drafting_fp64(setup, detach):
    target, head, feats, emb = setup
    steps = 4
    outs = Eagle3TTT(head, steps, detach).unroll(feats, emb)
    for t in range(L):
        drafted = chained(head, feats, emb, t, min(steps, L - t))
        for j, d in enumerate(drafted):
            err = (outs[j][0, t] - d[0]).abs().max().item()
            assert err < 1e-10, f"t={t} j={j}: {err}"


def test_detach_cuts_the_chain_and_gradients_reach_every_part(setup):
    target, head, feats, emb = setup
    for detach in (False, True):
        head.zero_grad()
        outs = Eagle3TTT(head, 2, detach).unroll(feats, emb)
        outs[0].retain_grad()
        outs[1].pow(2).sum().backward()
        assert (outs[0].grad is None) == detach  # HASS: the fed-back state enters detached
        assert head.fc.weight.grad.abs().sum() > 0  # through the step-0 keys in the cache either way
        assert head.midlayer.hidden_norm.weight.grad.abs().sum() > 0
    head.zero_grad()


# -- the drafter -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generator(tiny_dir):
    t = load_model(str(tiny_dir))
    t.model.double()
    g = selfspec.load(t, "hass", head="random-eagle3:3", total_tokens=9, top_k=3, depth=3, min_prob=0.0,
                      self_test=False)
    perturbed(g.drafter.head, 0.3)
    return g


def test_drafter_uses_the_heads_lm_head(generator):
    d = generator.drafter
    assert isinstance(d.head, Eagle3Head) and isinstance(d.lm_head, HeadLMHead)
    assert d.head.feature_layers == (0, 1, 2)  # a 3-layer target
    assert generator.drafter.source == "random-eagle3:3"


def test_pool_scores_are_sequential_draft_log_probs(generator):
    d = generator.drafter
    ids = prompt_ids(5, 11)
    target = generator.target.model
    with torch.no_grad():
        hidden = target.model(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
    d.cache, d.length = kv_cache.new_cache(d.head.config), 0
    d.features = target_features(d.head, [x[0] for x in hidden]).to(d.dtype)
    h_last = d.catch_up(ids)
    pool = d.expand(h_last, d.length)
    kv_cache.truncate(d.cache, d.length)
    stable = kv_cache.cache_length(d.cache)
    assert stable == len(ids) - 1
    emb = d.embed
    for i in range(pool.scores.numel()):
        chain = [i]
        while int(pool.parents[chain[-1]]) >= 0:
            chain.append(int(pool.parents[chain[-1]]))
        chain.reverse()
        h, total = h_last, 0.0
        for depth, node in enumerate(chain):
            lp = torch.log_softmax(d.head.logits(h[None]).double(), -1)[0]  # the head's own LM head
            tok = int(pool.tokens[node])
            total += float(lp[tok].detach())  # full vocabulary: draft index == token id
            if depth + 1 < len(chain):
                pos = stable + depth
                mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
                h = d.head(h[None, None], emb(torch.tensor([[tok]])).double(), torch.tensor([[pos]]), mask,
                           d.cache)[0, 0]
        kv_cache.truncate(d.cache, stable)
        assert math.isclose(total, float(pool.scores[i]), rel_tol=1e-9, abs_tol=1e-9), i


def test_stable_cache_equals_a_from_scratch_head_forward(generator):
    """After decoding, the head's stable cache holds exactly the encoding of the committed text with
    the fused target features of the chosen layers (so prefill/observe picked the right ones)."""
    d = generator.drafter
    ids = prompt_ids(7, 9)
    r = generator.generate(ids, max_new_tokens=12)
    full = ids + r.token_ids
    n = d.length
    assert 0 < n <= len(full) - 2
    with torch.no_grad():
        hidden = generator.target.model.model(input_ids=torch.tensor([full[:n]]), output_hidden_states=True
                                              ).hidden_states
        cache = kv_cache.new_cache(d.head.config)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        d.head(d.head.select_features(hidden), d.embed(torch.tensor([full[1 : n + 1]])).double(),
               torch.arange(n)[None], mask, cache)
    got, want = d.cache.layers[0], cache.layers[0]
    assert torch.allclose(got.keys[..., :n, :], want.keys, atol=1e-9)
    assert torch.allclose(got.values[..., :n, :], want.values, atol=1e-9)


def test_head_option_errors_are_one_line(tiny_dir, tmp_path):
    t = load_model(str(tiny_dir))
    with pytest.raises(SelfspecError, match="random-eagle3") as e:
        selfspec.load(t, "hass", head="random-eagle2:1", self_test=False)
    assert "\n" not in str(e.value)
    head = Eagle3Head(t.model, draft_vocab=DraftVocab(list(range(0, VOCAB, 2)), VOCAB))
    head.save(tmp_path / "h", {"target": t.name, "method": "hass"})
    with pytest.raises(SelfspecError, match="its own LM head over the vocabulary it was trained with") as e:
        selfspec.load(t, "hass", head=str(tmp_path / "h"), draft_vocab=0, self_test=False)
    assert "\n" not in str(e.value)
    g = selfspec.load(t, "hass", head=str(tmp_path / "h"), self_test=False)
    assert g.drafter.lm_head.size == VOCAB // 2 and torch.equal(g.drafter.lm_head.vocab.ids, head.draft_vocab.ids)


# -- greedy ids identical to generate ----------------------------------------------------------------

MAX_NEW = 23
PROMPTS = [prompt_ids(s, n) for s, n in [(0, 1), (1, 5), (2, 17), (3, 40)]]
CASES = {
    "fixed-tree": dict(head="random-eagle3:0", total_tokens=10, top_k=3, depth=3, min_prob=0.0),
    "cost-sized-tree": dict(head="random-eagle3:1", top_k=4, depth=2, min_prob=0.0),
    "chain": dict(head="random-eagle3:2", total_tokens=4, top_k=1, depth=4, min_prob=0.0),
    "reduced-vocab": dict(head="random-eagle3:4", total_tokens=10, top_k=3, depth=3, min_prob=0.0, draft_vocab=40),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request, tiny_dir, tiny_qwen_dir):
    return load_model(str(tiny_dir if request.param == "llama" else tiny_qwen_dir))


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target.model, p, MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize("case", list(CASES))
def test_random_eagle3_heads_match_generate(target, references, case):
    from ..conftest import write_draft_ranking

    opts = CASES[case]
    if "draft_vocab" in opts:
        write_draft_ranking(target.name, VOCAB, list(range(0, VOCAB, 2)))
    for method in ("hass", "eagle2"):
        g = selfspec.load(target, method, self_test=False, **opts)
        assert isinstance(g.drafter.head, Eagle3Head)
        assert (g.drafter.lm_head.vocab is None) == ("draft_vocab" not in opts)
        g.drafter = InvariantChecker(g.drafter)
        for p, ref in zip(PROMPTS, references):
            assert g.generate(p, max_new_tokens=MAX_NEW).token_ids == ref


@pytest.mark.parametrize("kernels", ["onednn", "int8"])
def test_eagle3_head_on_other_kernels_matches_generate(tiny_dir, kernels):
    """The head's LM head and its layer run on the target's backend (as EAGLE-2 heads' subsets);
    output unchanged."""
    from selfspec.kernels.swap import linear_layers

    t = load_model(str(tiny_dir), kernels=kernels)
    g = selfspec.load(t, "hass", self_test=False, **CASES["fixed-tree"])
    name = {"onednn": "OneDNNLinear", "int8": "Int8Linear"}[kernels]
    assert type(g.drafter.lm_head.lm).__name__ == name
    assert {type(layer).__name__ for _, _, layer in linear_layers(g.drafter.head)} == {name}
    for p in PROMPTS[1:3]:
        assert g.generate(p, max_new_tokens=MAX_NEW).token_ids == hf_greedy(t.model, p, MAX_NEW)
