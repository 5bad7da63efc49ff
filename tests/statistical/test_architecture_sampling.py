"""Coupled sampling draws from the target distribution on three kinds of attention (issue 59): full
(Llama), sliding-window (Mistral, a 2-position window, so every generated token's attention is
cut) and mixture-of-experts (Qwen2-MoE). Tiny random models over V = 6 tokens; the joint
distribution of the first three tokens that ``jacobi`` samples over seeds is compared by chi-square
and total variation with the exact one computed by the model's own ``transformers`` forward.
``jacobi`` verifies a block of several tokens at every step, each through selfspec's window masks.
Negative control: masks built without the window must fail on the sliding family."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.core.sampling import Warper
from selfspec.models import adapter as adapter_mod
from selfspec.models.loading import LoadedModel

from .conftest import PROMPT, V, check, exact_joint

pytestmark = pytest.mark.statistical

N = 2500
WINDOW = 2
FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, decoder_sparse_step=1),
}


def tiny(family: str) -> LoadedModel:
    """A 3-layer random ``family`` model over V = 6 tokens, with logits mild enough that many
    sequences have mass."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(5)
    cfg = AutoConfig.for_model(family, vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                               **FAMILIES[family])
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
        model.lm_head.weight.mul_(0.6)
    return LoadedModel(model=model.eval(), tokenizer=None, name=f"tiny-{family}-v6", path=None)


def sample(loaded: LoadedModel, warper: Warper, n: int) -> torch.Tensor:
    g = selfspec.load(loaded.runner("stock"), "jacobi", self_test=False, measure=False)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for seed in range(n):
        r = g.generate(PROMPT, max_new_tokens=3, temperature=warper.temperature, seed=seed, ignore_eos=True)
        a, b, c = r.token_ids[:3]
        counts[(a * V + b) * V + c] += 1
    return counts


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_coupled_sampling_matches_the_model(family):
    loaded, warper = tiny(family), Warper(1.0)
    pval, tv, bound = check(sample(loaded, warper, N), exact_joint(loaded.model, warper))
    assert pval > 1e-3, f"{family}: chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"{family}: TV {tv:.4f} above the bound {bound:.4f}"


def test_negative_control_window_ignored(monkeypatch):
    loaded, warper = tiny("mistral"), Warper(1.0)
    exact = exact_joint(loaded.model, warper)  # transformers' own forward, window applied
    build = adapter_mod.build_mask
    monkeypatch.setattr(adapter_mod, "build_mask", lambda *a, **k: build(*a[:6], **{**k, "window": None}))
    pval, tv, bound = check(sample(loaded, warper, 1500), exact)
    assert pval < 1e-3 or tv > bound, f"a verify path without the window passed: p={pval:.2e}, TV={tv:.4f}"
