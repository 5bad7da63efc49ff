"""self-spec pieces: the paper's gamma rule, the committed cache left untouched by drafting,
the exit-rule simulator of the tune proxy, and skip configs (lookup, override, refusal)."""

from __future__ import annotations

import json

import pytest
import torch

import selfspec
from selfspec.core.cost import CostProfile
from selfspec.drafters.budget import ChainBudget, DraftRule, GammaExit
from selfspec.drafters.skip_config import (
    GammaSettings,
    SkipConfig,
    config_hash,
    read,
    shipped_config_path,
    user_config_path,
)
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model
from selfspec.tune.objectives import simulate

from ..conftest import COMPILED_OFFERED, prompt_ids
from ..decoding.wrapped import Wrapped


def test_gamma_rule_follows_the_paper():
    g = GammaExit(GammaSettings(gamma0=0.6, alpha=0.85, epsilon=0.01, beta1=0.5, beta2=0.9))
    g.update(2, 4)  # first cycle: AR = AR_e = 0.5 <= alpha -> gamma rises by (1 - beta2) * eps
    assert g.ar == pytest.approx(0.5) and g.gamma == pytest.approx(0.601)
    g.update(4, 4)  # AR = 0.5 * 0.5 + 0.5 * 1.0 = 0.75 <= alpha -> rises again
    assert g.ar == pytest.approx(0.75) and g.gamma == pytest.approx(0.602)
    g.update(4, 4)  # AR = 0.875 > alpha -> falls
    assert g.ar == pytest.approx(0.875) and g.gamma == pytest.approx(0.601)
    g.new_prompt()  # AR resets, gamma is carried over
    assert g.ar is None and g.gamma == pytest.approx(0.601)
    assert g.stop(0.5) and not g.stop(0.7)


def test_drafting_leaves_the_committed_cache_untouched(tiny_dir):
    target = load_model(str(tiny_dir))
    g = selfspec.load(target, "self-spec", skip_attention=(1,), skip_mlp=(0, 2), auto_k=False, k=4,
                      self_test=False)
    snapshots = []

    class Spy(Wrapped):
        def propose(self, state, budget=None):
            before = [(layer.keys.clone(), layer.values.clone()) for layer in state.cache.layers]
            proposal = self.inner.propose(state, budget)
            after = [(layer.keys, layer.values) for layer in state.cache.layers]
            snapshots.append(all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after)))
            assert proposal.tree.size == 1 + min(4, state.draft_room)
            return proposal

    g.drafter = Spy(g.drafter)
    g.generate(prompt_ids(3, 11), max_new_tokens=20)
    assert snapshots and all(snapshots)


def _rule(prof, draft_exit, draft_s=0.5):
    """The decoder's rule over a fresh budget (its cost prior: ``draft_s`` T(1) a token)."""
    budget = ChainBudget(prof, 4)
    budget.set_prior(budget.alpha, draft_s * prof.t1)
    return DraftRule(budget, GammaExit(GammaSettings(gamma0=0.0)), draft_exit, True, 0.3)  # gamma never stops


def test_simulate_replays_the_decoders_rule():
    """The tuner's proxy replays the drafter's own DraftRule: its draft length, exit, verified
    prefix and updates (a flat cost profile: verifying more is free)."""
    prof = CostProfile((1, 2, 3, 4, 5), (1.0, 1.0, 1.0, 1.0, 1.0), 0, "flat")
    flags = [True, True, False, True, True, True]
    tokens, cost, drafted, accepted = simulate(flags, [0.9] * 6, _rule(prof, "gamma"), 0.5, prof)
    # cycle 1 drafts 4 (pos 0..3), accepts 2 -> 3 tokens; cycle 2 at pos 3 drafts 3, accepts 3 -> 4 tokens
    assert (tokens, drafted, accepted) == (7, 7, 5)
    assert cost == pytest.approx(7 * 0.5 + 2 * 1.0)
    rule = _rule(prof, "cost", 0.0)  # a draft believed free: the budget lets it run to its length
    tokens, _, drafted, accepted = simulate(flags, [0.9, 0.2, 0.9, 0.9, 0.9, 0.9], rule, 0.5, prof)
    # the low confidence at pos 1 ends the first draft after 2; having measured 0.5 T(1) a draft
    # token there, the budget sizes the next draft at 2, not the 3 that are left
    assert (tokens, drafted, accepted) == (6, 4, 4)
    assert rule.budget.draft_cost > 0 and rule.budget.alpha > _rule(prof, "cost").budget.alpha  # it learned
    # a draft that costs 3 T(1) a token never pays: the rule backs off to plain steps (probes aside)
    tokens, cost, drafted, _ = simulate([True] * 6, [0.9] * 6, _rule(prof, "cost", 3.0), 3.0, prof)
    assert drafted == 0 and tokens == 6 and cost == pytest.approx(6.0)


def _config(target, name=None, attn=(1,), mlp=()):
    return SkipConfig(model=name or target.name, config_hash=config_hash(target.model), num_layers=3,
                      skip_attention=attn, skip_mlp=mlp)


def test_skip_config_round_trip_and_lookup(tiny_dir, tmp_path):
    target = load_model(str(tiny_dir))
    with pytest.raises(SelfspecError, match="selfspec tune"):
        selfspec.load(target, "self-spec", self_test=False)
    _config(target, attn=(2,), mlp=(0,)).save(user_config_path(target.name))
    g = selfspec.load(target, "self-spec", self_test=False)  # picked up automatically
    assert (g.drafter.skip.attention, g.drafter.skip.mlp) == ((2,), (0,))
    other = _config(target, attn=(0,), mlp=()).save(tmp_path / "mine.json")
    g = selfspec.load(target, "self-spec", skip_config=str(other), self_test=False)  # the override wins
    assert g.drafter.skip.attention == (0,) and g.drafter.source == str(other)
    assert read(other) == _config(target, attn=(0,), mlp=())
    user_config_path(target.name).unlink()


def test_skip_config_for_another_model_is_refused(tiny_dir, tiny_qwen_dir, tmp_path):
    target = load_model(str(tiny_dir))
    qwen = load_model(str(tiny_qwen_dir))
    wrong_name = _config(target, name="someone-else").save(tmp_path / "a.json")
    with pytest.raises(SelfspecError, match="tuned for model 'someone-else'"):
        selfspec.load(target, "self-spec", skip_config=str(wrong_name), self_test=False)
    wrong_arch = SkipConfig(model=target.name, config_hash=config_hash(qwen.model), num_layers=3,
                            skip_attention=(1,), skip_mlp=())
    wrong_arch.save(tmp_path / "b.json")
    with pytest.raises(SelfspecError, match=f"tuned for another model named '{target.name}' .*; tune this one"):
        selfspec.load(target, "self-spec", skip_config=str(tmp_path / "b.json"), self_test=False)
    (tmp_path / "c.json").write_text(json.dumps({"format": "something"}))
    with pytest.raises(SelfspecError, match="not a valid skip config"):
        selfspec.load(target, "self-spec", skip_config=str(tmp_path / "c.json"), self_test=False)
    with pytest.raises(SelfspecError, match="does not exist"):
        selfspec.load(target, "self-spec", skip_config=str(tmp_path / "none.json"), self_test=False)
    with pytest.raises(SelfspecError, match="layers 0..2"):
        selfspec.load(target, "self-spec", skip_attention=(7,), self_test=False)
    with pytest.raises(SelfspecError, match="draft_exit"):
        selfspec.load(target, "self-spec", skip_attention=(1,), draft_exit="sometimes", self_test=False)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_shipped_configs_parse(name):
    path = shipped_config_path(name)
    assert path is not None, f"no shipped skip config for {name}"
    cfg = read(path)
    assert cfg.model == name and cfg.search["trials"] > 0
    skipped = len(cfg.skip_attention) + len(cfg.skip_mlp)
    assert skipped < 2 * cfg.num_layers
    # the draft differs from the full model: sub-layers skipped, or its own (int8) kernels
    assert skipped > 0 or cfg.draft_kernels != "same"
    assert cfg.draft_kernels in ("same", "int8") and cfg.draft_vocab >= 0


def test_whole_model_int8_draft_runs_through_its_own_step_on_the_compiled_backend(tiny_dir, tmp_path, monkeypatch):
    """On the compiled backend, self-spec's int8 draft of the whole model with its own LM head
    drafts through a one-token step of its own (here run eagerly, ``compile=False``: what runs,
    not how fast), on the request's static cache, under the int8 layers; ids are ``ar``'s on the
    same backend. Negative controls: a skip set or a reduced draft vocabulary keeps the eager draft."""
    from selfspec.models.compiled_step import StaticStep
    from selfspec.models.loading import LoadedModel, Runner

    from ..conftest import VOCAB, write_draft_ranking

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    base = load_model(str(tiny_dir), kernels="stock")
    write_draft_ranking("tiny-draft-step", VOCAB, list(range(0, VOCAB, 2)))

    def on_compiled() -> Runner:
        named = LoadedModel(model=base.model, tokenizer=base.tokenizer, name="tiny-draft-step", path=None)
        return Runner(named, base.model, "compiled", _step=StaticStep(base.model, compile=False))

    ref = selfspec.load(on_compiled(), "ar", self_test=False).generate(prompt_ids(0, 8), max_new_tokens=12).token_ids
    g = selfspec.load(on_compiled(), "self-spec", self_test=False, skip_attention=(), skip_mlp=(), k=3, auto_k=False,
                      draft_kernels="int8", draft_vocab=0)
    step = g.drafter.draft_step
    assert step is not None and step is not g.target.step and g.drafter.layers.extra_bytes > 0
    assert step.model is g.drafter.layers.model is g.drafter.draft_model and step.model is not g.target.model
    calls = []
    real = step.forward
    monkeypatch.setattr(step, "forward", lambda cache, ids, *a, **kw: calls.append(ids.numel()) or real(
        cache, ids, *a, **kw))
    r = g.generate(prompt_ids(0, 8), max_new_tokens=12)
    assert r.token_ids == ref and calls and set(calls) == {1}
    for opts in (dict(skip_attention=(1,), skip_mlp=()), dict(skip_attention=(), skip_mlp=(), draft_vocab=48)):
        other = selfspec.load(on_compiled(), "self-spec", self_test=False, k=3, auto_k=False, draft_kernels="int8",
                              **{"draft_vocab": 0, **opts})
        assert other.drafter.draft_step is None


@COMPILED_OFFERED
def test_the_draft_steps_file_is_named_without_building_it(tiny_dir, tmp_path, monkeypatch):
    """Whether self-spec's int8 draft step is saved is told without quantising the model (seconds on
    SmolLM2, which ``auto`` would pay at every load): the file named from the classes the int8 draft
    layers would have is the one the step of the built draft's module tree saves under (with its
    layout). Negative controls: the verify step's name and the layers without the layout differ;
    options whose draft runs eagerly (a skip set, the verify kernels) have no step to miss."""
    from selfspec.drafters.self_spec import SelfSpecConfig, draft_step_missing
    from selfspec.kernels.int8 import layer_classes
    from selfspec.kernels.switch import DraftLayers
    from selfspec.models import aot_step
    from selfspec.models.compiled_step import MIN_CAPACITY

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    target = load_model(str(tiny_dir), kernels="compiled")  # compiles nothing until a step runs
    model = target.model
    shape = [(1, MIN_CAPACITY, False)]
    named = aot_step.artifact_paths(str(tmp_path), model, shape, linears=layer_classes(model), layout=True)[0]
    draft = DraftLayers(model, "int8")
    assert draft.add_layout()
    built = aot_step.artifact_paths(str(tmp_path), draft.model, shape)[0]
    assert named == built
    assert aot_step.artifact_paths(str(tmp_path), model, shape)[0] != built  # the verify step's
    assert aot_step.artifact_paths(str(tmp_path), model, shape, linears=layer_classes(model))[0] != built

    int8_draft = SelfSpecConfig(skip_attention=(), skip_mlp=(), draft_kernels="int8")
    assert draft_step_missing(target, int8_draft)
    for eager in (SelfSpecConfig(skip_attention=(1,), skip_mlp=(), draft_kernels="int8"),
                  SelfSpecConfig(skip_attention=(), skip_mlp=(), draft_kernels="same")):
        assert not draft_step_missing(target, eager)
    built.parent.mkdir(parents=True, exist_ok=True)
    built.write_bytes(b"")  # saved (pretended)
    assert not draft_step_missing(target, int8_draft)
