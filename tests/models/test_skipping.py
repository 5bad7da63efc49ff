"""Sub-layer skipping: equals zeroing the sub-layer's output projection, writes no KV for
skipped attention, and leaves the model it was built from untouched (a module tree of its own)."""

from __future__ import annotations

import copy

import pytest
import torch

from selfspec.core import kv_cache
from selfspec.errors import SelfspecError
from selfspec.models.skipping import SkipSet, decoder_layers, skipped

from ..conftest import prompt_ids, tiny_model


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attn,mlp", [((0,), ()), ((), (1,)), ((0, 2), (1, 2)), ((0, 1, 2), (0, 1, 2))])
def test_skip_equals_zeroed_projection(family, attn, mlp):
    model = tiny_model(family, layers=3)
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        for i in attn:
            decoder_layers(zeroed)[i].self_attn.o_proj.weight.zero_()
        for i in mlp:
            decoder_layers(zeroed)[i].mlp.down_proj.weight.zero_()
    ids = prompt_ids(0, 12)
    out = _logits(skipped(model, SkipSet.of(attn, mlp)), ids)
    torch.testing.assert_close(out, _logits(zeroed, ids), rtol=0, atol=1e-5)
    assert not torch.allclose(out, _logits(model, ids))  # and it did change something


def test_skipped_attention_writes_no_kv_and_leaves_the_model_as_it_is():
    model = tiny_model("llama", layers=3)
    ids = prompt_ids(1, 9)
    before = _logits(model, ids)
    cache = kv_cache.new_cache(model.config)
    draft = skipped(model, SkipSet.of((1,), (0,)))
    with torch.inference_mode():
        draft(input_ids=torch.tensor([ids]), **kv_cache.cache_arg(draft, cache), use_cache=True)
    lengths = [layer.keys.shape[-2] if layer.is_initialized else 0 for layer in cache.layers]
    assert lengths == [9, 0, 9]
    assert all("forward" not in b.self_attn.__dict__ and "forward" not in b.mlp.__dict__ for b in decoder_layers(model))
    assert all(type(b.self_attn).__name__ != "SkippedAttention" for b in decoder_layers(model))
    torch.testing.assert_close(_logits(model, ids), before, rtol=0, atol=0)
    assert {p.data_ptr() for p in draft.parameters()} <= {p.data_ptr() for p in model.parameters()}  # same weights


def test_nothing_skipped_is_the_model_itself():
    model = tiny_model("llama", layers=2)
    assert skipped(model, SkipSet()) is model


def test_bad_layer_index_is_refused():
    model = tiny_model("llama", layers=2)
    with pytest.raises(SelfspecError, match="layers 0..1"):
        skipped(model, SkipSet.of((5,), ()))
