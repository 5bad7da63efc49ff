"""int8 backend: exact integer accumulation and row-wise attention make verification logits
bit-identical to one-token decoding of the same quantised model, for any block size."""

from __future__ import annotations

import pytest
import torch

from selfspec.core import kv_cache
from selfspec.kernels import int8
from selfspec.kernels.int8 import Int8Linear, quantize_rows
from selfspec.models.loading import load_model
from selfspec.models.selftest import tree_self_test

from ..conftest import bundled_path


@pytest.fixture(scope="module")
def smol_int8():
    """A private SmolLM2 on int8 kernels (the shared fixture stays on stock)."""
    return load_model(bundled_path("smollm2-135m-instruct"), kernels="int8")


def test_quantize_rows_is_symmetric_per_row():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3.0, 0.0, -3.0]])
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert torch.equal(q[1], torch.zeros(3, dtype=torch.int8))
    assert torch.allclose(q.float() * s, x, atol=s.max().item())


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_rows_do_not_depend_on_the_batch(bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=bias)
    layer = Int8Linear(lin)
    x = torch.randn(16, 96) * torch.logspace(-2, 2, 16)[:, None]  # very different row magnitudes
    alone = torch.cat([layer(x[i:i + 1]) for i in range(16)])
    for m in range(1, 17):
        assert torch.equal(layer(x[:m]), alone[:m])
    assert torch.equal(layer(x[None, :5]), alone[None, :5])  # any leading shape
    rel = (layer(x) - lin(x)).norm() / lin(x).norm()
    assert 0 < rel < 0.02  # quantised, but close


@pytest.mark.parametrize("kernel", ["fbgemm", "onednn"])
def test_int8_kernels_agree_exactly(kernel):
    """Each fast CPU kernel that is exact here gives torch._int_mm's result bit for bit."""
    bits = int8.activation_bits("cpu")
    if not int8._exact(kernel, bits):
        pytest.skip(f"{kernel} is not exact for {bits}-bit activations on this CPU (the probe refuses it)")
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 48)
    a, b = int8.Int8Matmul(lin.weight, lin.bias, kernel), int8.Int8Matmul(lin.weight, lin.bias, "int_mm")
    x = torch.randn(7, 64) * torch.logspace(-2, 2, 7)[:, None]
    assert torch.equal(a(x), b(x))


def test_cpu_int8_path_is_exact_and_sound():
    """The probe's choice gives exact sums on the worst case; where it picked 7 bits, 8 bits saturate."""
    kernel, bits = int8.cpu_int8_path()
    if not int8.fast_cpu_int8():
        pytest.skip("needs a CPU with an exact fast int8 matmul (AVX2 or VNNI; the probe found none here)")
    assert int8._exact(kernel, bits)
    if bits == 7:  # no VNNI: 8-bit activations saturate (negative control: the probe can fail)
        assert not int8._exact(kernel, 8)
    assert int8.activation_bits("cpu") == bits


def test_int8_layer_is_exact_at_the_largest_activations():
    """Every row at full scale (the saturating case on CPUs without VNNI) equals the int64 sum."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(512, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.sign(torch.randn(64, 512)))  # every weight quantises to +-127
    layer = Int8Linear(lin)
    x = torch.sign(torch.randn(4, 512))  # every activation quantises to +-qmax
    qmax = layer.matmul.act_qmax
    wq, ws = quantize_rows(lin.weight.detach())
    xq, xs = quantize_rows(x, qmax)
    exact = (xq.to(torch.int64) @ wq.to(torch.int64).t()).double() * ws.double().t() * xs.double()
    assert torch.allclose(layer(x).double(), exact, rtol=1e-6, atol=0)


def one_token_logits(model, ids: list[int], prefix: int) -> torch.Tensor:
    """Logits of tokens prefix.. decoded one at a time after a batched prefill: ``[len - prefix, V]``."""
    cache = kv_cache.new_cache(model.config)
    model(input_ids=torch.tensor([ids[:prefix]]), **kv_cache.cache_arg(model, cache), use_cache=True)
    rows = []
    for i in range(prefix, len(ids)):
        out = model(input_ids=torch.tensor([[ids[i]]]), position_ids=torch.tensor([[i]]),
                    **kv_cache.cache_arg(model, cache), use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


def block_differences(model, ids: list[int], prefix: int, qs) -> list[float]:
    """Largest |verify logits - one-token logits| for each block size q."""
    ref = one_token_logits(model, ids, prefix)
    cache = kv_cache.new_cache(model.config)
    model(input_ids=torch.tensor([ids[:prefix]]), **kv_cache.cache_arg(model, cache), use_cache=True)
    worst = []
    for q in qs:
        kv_cache.truncate(cache, prefix)
        out = model(input_ids=torch.tensor([ids[prefix:prefix + q]]),
                    position_ids=torch.arange(prefix, prefix + q)[None], **kv_cache.cache_arg(model, cache),
                    use_cache=True)
        worst.append(float((out.logits[0] - ref[:q]).abs().max()))
    return worst


@pytest.mark.real_model
@torch.inference_mode()
def test_verify_logits_bit_identical_to_one_token_decoding(smol_int8):
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
    ids = smol_int8.tokenizer(text)["input_ids"]
    assert len(ids) >= 12 + 16
    assert block_differences(smol_int8.model, ids, 12, range(1, 17)) == [0.0] * 16


@pytest.mark.real_model
@torch.inference_mode()
def test_negative_control_batched_attention_breaks_bit_identity(smol_int8):
    """The same check fails with int8 linears but the stock batched attention: the test can fail."""
    model = smol_int8.model
    ids = smol_int8.tokenizer("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]
    model.set_attn_implementation("sdpa")
    try:
        worst = block_differences(model, ids, 12, range(1, 17))
    finally:
        model.set_attn_implementation("selfspec_rowwise")
    assert max(worst) > 0


@pytest.mark.real_model
@torch.inference_mode()
def test_tree_rows_bit_identical_to_their_paths(smol_int8):
    assert tree_self_test(smol_int8.model) == 0.0


@torch.inference_mode()
def test_tree_rows_bit_identical_to_their_paths_tiny(tiny_dir):
    tiny = load_model(str(tiny_dir), kernels="int8")
    assert tree_self_test(tiny.model) == 0.0


@torch.inference_mode()
def test_the_int8_runner_leaves_the_stock_runner_as_it_is(tiny_dir):
    t = load_model(str(tiny_dir))
    ids = torch.tensor([[5, 9, 11, 4, 30]])
    before = t.model(input_ids=ids).logits
    q = t.runner("int8")
    assert q.backend == "int8"
    quantised = q.model(input_ids=ids).logits
    assert not torch.equal(before, quantised)
    assert t.backend == "stock" and t.model.config._attn_implementation == "sdpa"
    assert torch.equal(t.model(input_ids=ids).logits, before)


def test_sibling_group_is_bit_identical_to_separate_layers():
    from selfspec.kernels.int8 import Int8Group, Int8GroupMember

    torch.manual_seed(2)
    layers = [torch.nn.Linear(64, n, bias=b) for n, b in ((64, True), (32, False), (32, True))]
    group = Int8Group(layers)
    members = [Int8GroupMember(layer, group, i) for i, layer in enumerate(layers)]
    x = torch.randn(1, 5, 64)
    for _ in range(2):  # the second round must recompute, not reuse consumed outputs
        for layer, member in zip(layers, members):
            assert torch.equal(member(x), Int8Linear(layer)(x))
    assert torch.equal(members[1](x), members[1](x))  # the same sibling twice: recomputed
    y = x.clone()
    assert torch.equal(members[0](x), Int8Linear(layers[0])(x))
    y += 1  # a different input object is never served from the cache
    assert torch.equal(members[1](y), Int8Linear(layers[1])(y))


def test_int8_promise_holds_here_or_falls_back_to_stock(tiny_dir, caplog):
    """The load-time check of int8's bit-identity promise: kept where the rows are identical; where
    the probe finds a difference (injected: a CPU whose kernels break it), stock kernels and a note."""
    from selfspec.models.selftest import keep_int8_promise

    t = load_model(str(tiny_dir), kernels="int8")
    assert keep_int8_promise(t) is t  # the real probe on this machine
    stock = keep_int8_promise(t, probe=lambda m: 3e-7)
    assert stock.backend == "stock" and stock is t.runner("stock") and t.backend == "int8"
    assert "not bit-identical" in caplog.text and "stock" in caplog.text
    assert keep_int8_promise(stock, probe=lambda m: 1.0) is stock  # nothing to check on stock


class RowVariant(torch.nn.Module):
    """A linear layer whose rows depend on how many rows its block has (a kernel that breaks the
    promise, by construction): its output scaled by 1 + 1e-4 per row of the block."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y * (1 + 1e-4 * x.shape[-2])


@pytest.mark.real_model
@torch.inference_mode()
def test_int8_promise_probe_catches_a_row_variant_kernel(tiny_dir):
    """Negative control of the real probe: one int8 layer whose rows depend on the block's size
    breaks the promise, and the probe finds it (it can fail). (It once used the stock batched SDPA
    attention, whose rows differed on the AMD EPYCs and did not on a 2-core Intel Xeon: a property
    of a CPU, not a kernel that breaks the promise by construction.)"""
    from selfspec.models.selftest import keep_int8_promise

    t = load_model(bundled_path("smollm2-135m-instruct"), kernels="int8")
    mlp = t.model.model.layers[0].mlp
    mlp.down_proj = RowVariant(mlp.down_proj)
    assert keep_int8_promise(t).backend == "stock"
