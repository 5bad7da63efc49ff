"""bf16 draft kernels: close to fp32 (never exact: drafts only), offered to ``auto`` only where
the CPU multiplies bf16 natively, and a probe that says why not in one line."""

import pytest
import torch
from torch import nn

from selfspec.kernels import bf16
from selfspec.kernels.backends import convert_linear
from selfspec.kernels.switch import DraftLayers, draft_precisions
from selfspec.models.loading import load_model


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir), kernels="stock")


def test_bf16_linear_is_close_to_fp32_and_keeps_the_input_dtype():
    torch.manual_seed(0)
    layer = nn.Linear(96, 40)
    x = torch.randn(2, 3, 96)
    y = bf16.Bf16Linear(layer)(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float32
    want = layer(x)
    assert torch.allclose(y, want, rtol=0.05, atol=0.05)
    assert not torch.equal(y, want)  # bf16 rounding shows: this is a draft kernel, not a verify one
    assert isinstance(convert_linear(layer, "bf16"), bf16.Bf16Linear)


def test_native_reason_names_the_missing_units():
    assert "no native bf16" in bf16.native_reason("cpu", frozenset({"avx2", "fma"}))
    assert bf16.native_reason("cpu", frozenset({"avx2", "avx512_bf16"})) is None  # the probe passes
    assert bf16.native_reason("cuda") is None
    assert "CPU and CUDA only" in bf16.native_reason("mps")


def test_draft_precisions_here_always_include_same_and_int8():
    usable, left_out = draft_precisions("cpu")
    assert usable[:2] == ("same", "int8")
    assert ("bf16" in usable) != ("bf16" in left_out)


def test_draft_layers_run_bf16_beside_the_untouched_model(tiny):
    model = tiny.model
    before = [type(m) for m in model.modules()]
    draft_layers = DraftLayers(model, "bf16")
    assert draft_layers.extra_bytes > 0
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        ref = model(ids).logits
        assert any(isinstance(m, bf16.Bf16Linear) for m in draft_layers.model.modules())
        draft = draft_layers.model(ids).logits
        again = model(ids).logits
    assert [type(m) for m in model.modules()] == before
    assert torch.equal(again, ref)  # verification is untouched
    assert torch.allclose(draft, ref, rtol=0.1, atol=0.1)
