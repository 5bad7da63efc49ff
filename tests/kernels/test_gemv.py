"""The compiled step's few-row products: the blocked layout, the product, and where it runs."""

from __future__ import annotations

import pytest
import torch

from selfspec.kernels import gemv
from selfspec.kernels.onednn import OneDNNLinear, SharedProductLinear, add_blocked
from selfspec.kernels.swap import linear_layers
from selfspec.models.loading import load_model

from ..conftest import COMPILED_OFFERED


def test_blocked_layout_interleaves_one_vector_of_output_rows():
    b = gemv.BLOCK
    w = torch.arange(2 * b * 3, dtype=torch.float32).reshape(2 * b, 3)
    wb = gemv.blocked(w)
    assert wb.shape == (2, 3, b) and wb.is_contiguous()
    for j in range(2):
        for k in range(3):
            for i in range(b):
                assert wb[j, k, i] == w[j * b + i, k]
    assert gemv.blocked(torch.zeros(12, 3)) is None  # 12 rows: not a whole number of blocks


@pytest.mark.parametrize(("capability", "lanes"), [("AVX512", 16), ("AVX2", 8), ("DEFAULT", 8), ("SVE256", 8)])
def test_the_block_is_one_vector_register_of_fp32(capability, lanes):
    assert gemv.vector_lanes(capability) == lanes
    assert gemv.BLOCK == gemv.vector_lanes(torch.backends.cpu.get_cpu_capability())
    assert gemv.LAYOUT == f"gemv-blocked{gemv.BLOCK}-rows{gemv.ROWS}"  # saved steps' names tell the widths apart


@pytest.mark.parametrize("rows", [1, 3, gemv.ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_is_the_linear_product(bias, rows):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    wb, b = gemv.blocked(layer.weight), layer.bias.detach() if bias else None
    got = gemv.gemv(x, wb, b)
    assert got.shape == (rows, 80)
    for m in range(rows):  # each row is its own reduction: the same values as the row alone
        assert torch.equal(got[m:m + 1], gemv.gemv(x[m:m + 1], wb, b))
    torch.testing.assert_close(got, layer(x).detach(), atol=1e-5, rtol=1e-5)
    wrong = gemv.gemv(x, gemv.blocked(layer.weight.flip(0)), None)  # negative control: rows out of place
    assert not torch.allclose(wrong, layer(x).detach() - (layer.bias.detach() if bias else 0), atol=1e-3)


@pytest.mark.parametrize("rows", [1, gemv.ROWS])
def test_gemv_over_int8_weights_is_the_dequantised_product(rows):
    """int8 weights in the layout with one scale per output row: the product of the dequantised
    weights (each weight converted as it is read, each output scaled after its sum). Negative
    control: without the scales the outputs are off by them."""
    from selfspec.kernels.int8 import quantize_rows

    torch.manual_seed(0)
    w, x, b = torch.randn(80, 48), torch.randn(rows, 48), torch.randn(80)
    q, scale = quantize_rows(w)
    wb = gemv.blocked(q)
    assert wb.dtype == torch.int8
    got = gemv.gemv(x, wb, b, scale.reshape(-1))
    torch.testing.assert_close(got, x @ (q.float() * scale).T + b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(gemv.gemv(x, wb, b), got, atol=1e-2)


@pytest.mark.matrix  # compiles two graphs
@torch.inference_mode()
def test_compiled_int8_layers_read_int8_weights_in_the_layout():
    """Traced, an int8 layer and an int8 group member with the draft layout
    (:meth:`LinearSwitch.add_layout`) run the dequantised weight-only product in Inductor's loop
    (no int8 kernel call); eagerly they keep their int8 kernel (int8 activations too)."""
    from torch._inductor.utils import run_and_get_code

    from selfspec.kernels.int8 import Int8Group, Int8GroupMember, Int8Linear, quantize_rows

    torch.manual_seed(0)
    lin, sib = torch.nn.Linear(64, 96), torch.nn.Linear(64, 32)
    members = [Int8GroupMember(lin, Int8Group([lin, sib]), 0), Int8Linear(lin)]
    x = torch.randn(gemv.ROWS, 64)
    q, scale = quantize_rows(lin.weight.detach())
    want = x @ (q.float() * scale).T + lin.bias.detach()
    for layer in members:
        assert layer.add_layout() and layer.blocked.dtype == torch.int8
        got, code = run_and_get_code(torch.compile(lambda v, m=layer: m(v), dynamic=False, fullgraph=True), x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert not any("qlinear" in c or "_int_mm" in c for c in code)
        assert not torch.equal(layer(x), got)  # eager: its int8 kernel, activations rounded to 8 bits


@pytest.mark.matrix  # compiles three graphs
@torch.inference_mode()
def test_compiled_layer_runs_few_row_blocks_on_the_blocked_layout():
    """Traced, a oneDNN layer with the layout computes blocks of up to ``gemv.ROWS`` rows as
    Inductor's own reductions (no oneDNN call in the generated code) and a larger block with
    oneDNN; all give the layer's values up to rounding."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    layer = OneDNNLinear(torch.nn.Linear(64, 96))
    x = torch.randn(2 * gemv.ROWS, 64)
    eager = layer(x)
    assert add_blocked(torch.nn.Sequential(layer), budget=1 << 30) == 96 * 64 * 4
    fn = torch.compile(lambda v: layer(v), dynamic=False, fullgraph=True)
    for rows in (1, gemv.ROWS):
        few, code = run_and_get_code(fn, x[:rows])
        assert not any("onednn_linear" in c for c in code)
        torch.testing.assert_close(few, eager[:rows], atol=1e-5, rtol=1e-5)
    many, code = run_and_get_code(fn, x)
    assert any("torch.ops.selfspec.onednn_linear.default(" in c for c in code)
    assert torch.equal(many, eager)


@pytest.mark.matrix  # compiles four graphs
@torch.inference_mode()
def test_step_options_compute_a_normalised_input_once_for_all_rows():
    """With the compiled step's Inductor options, the products of a few-row block read a stored
    normalised input (its square root appears as often in the code for 4 rows as for 1); with
    Inductor's defaults (the negative control) the normalisation is recomputed inside the
    products' loop, once per row."""
    from torch._inductor.utils import run_and_get_code

    from selfspec.models.aot_step import INDUCTOR_OPTIONS

    torch.manual_seed(0)
    layer = OneDNNLinear(torch.nn.Linear(64, 96))
    add_blocked(torch.nn.Sequential(layer), budget=1 << 30)

    def norm_then_product(v: torch.Tensor) -> torch.Tensor:
        return layer(v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5))

    def sqrts(options: dict, rows: int) -> int:
        torch._dynamo.reset()
        fn = torch.compile(norm_then_product, dynamic=False, fullgraph=True, options=options)
        return sum(c.count("sqrt") for c in run_and_get_code(fn, torch.randn(rows, 64))[1])

    assert sqrts(INDUCTOR_OPTIONS, 4) == sqrts(INDUCTOR_OPTIONS, 1)
    assert sqrts({}, 4) > sqrts({}, 1)


@pytest.mark.matrix  # compiles two graphs
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="the vector widths this test knows are x86's")
@torch.inference_mode()
def test_the_products_loop_reads_whole_vectors_of_the_layout():
    """Compiled, the product over the layout of :data:`gemv.BLOCK` lanes loads whole vectors and
    keeps each output block's sum in one thread; negative control: a layout of half the lanes
    (8 on an AVX-512 CPU, what made its compiled step 4x slower) is read with masked loads and
    reduced with masked sums."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    w, x = torch.randn(4 * gemv.BLOCK, 64), torch.randn(1, 64)

    def code(lanes: int) -> str:
        torch._dynamo.reset()
        wb = w.reshape(-1, lanes, 64).transpose(1, 2).contiguous()
        fn = torch.compile(gemv.gemv, dynamic=False, fullgraph=True)
        y, src = run_and_get_code(fn, x, wb)
        torch.testing.assert_close(y, x @ w.T, atol=1e-5, rtol=1e-5)
        return "\n".join(src)

    assert "sum_masked_reduce" not in code(gemv.BLOCK)
    assert "sum_masked_reduce" in code(gemv.BLOCK // 2)


@COMPILED_OFFERED
@torch.inference_mode()
def test_compiled_backend_adds_the_layout_within_its_memory_budget(tiny_dir):
    t = load_model(str(tiny_dir), kernels="compiled")
    layers = [m for _, _, m in linear_layers(t.model)]
    assert layers and all(isinstance(m, (OneDNNLinear, SharedProductLinear)) for m in layers)
    assert all(m.blocked is not None for m in layers if m.out_features % gemv.BLOCK == 0)
    for m in layers:
        if m.blocked is not None:
            assert torch.equal(m.blocked, gemv.blocked(m.original.weight))
    for m in layers:
        m.blocked = None
    assert add_blocked(t.model, budget=0) is None  # no room for the copy: oneDNN for every block
    assert all(m.blocked is None for m in layers)
