"""The ``compact`` backend: weights read as the GGUF blocks they are (proven bit for bit), fp32
sums, and a row's result independent of the block it comes in."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from selfspec.errors import SelfspecError
from selfspec.kernels import current_backend
from selfspec.kernels.compact import (
    CompactLinear,
    _build,
    available,
    compact_linear,
    isa,
    load_ops,
    q4_1_blocks,
    q8_0_blocks,
)
from selfspec.kernels.onednn import OneDNNLinear
from selfspec.kernels.onednn import available as onednn_available
from selfspec.kernels.swap import linear_layers
from selfspec.models.loading import load_model

from ..conftest import gguf_rounded

NO_COMPACT = available(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(NO_COMPACT is not None, reason=str(NO_COMPACT))
PROVERS = {"Q4_1": q4_1_blocks, "Q8_0": q8_0_blocks}


def layer_of(w: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    load_ops()
    return compact_linear(lin)


@pytest.mark.parametrize("kind", list(PROVERS))
def test_provers_find_blocks_and_refuse_other_weights(kind):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.1
    assert PROVERS[kind](w) is None  # plain fp32 weights are no blocks
    rounded = gguf_rounded(w, kind)
    assert PROVERS[kind](rounded) is not None
    rounded[3, 7] = torch.nextafter(rounded[3, 7], torch.tensor(1.0))  # one weight one ulp off
    assert PROVERS[kind](rounded) is None
    assert PROVERS[kind](gguf_rounded(w, kind)[:, :100]) is None  # K not a whole number of blocks


@pytest.mark.parametrize("kind", list(PROVERS))
def test_the_kernel_reads_the_fp32_weights_bit_for_bit(kind):
    w = gguf_rounded(torch.randn(96, 160, generator=torch.Generator().manual_seed(1)) * 0.2, kind)
    layer = layer_of(w)
    assert isinstance(layer, CompactLinear) and layer.kind == kind
    assert torch.equal(layer(torch.eye(160)), w.t())  # one-hot rows read every weight back


@pytest.mark.parametrize("kind", list(PROVERS))
def test_a_rows_result_does_not_depend_on_its_block(kind):
    g = torch.Generator().manual_seed(2)
    w = gguf_rounded(torch.randn(80, 192, generator=g) * 0.2, kind)
    bias = torch.randn(80, generator=g)
    layer = layer_of(w, bias)
    x = torch.randn(41, 192, generator=g)  # more rows than one pass over a weight tile reads (32)
    full = layer(x)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 33):  # in registers (6, or 12 with AVX-512); tiles
        assert torch.equal(layer(x[:rows]), full[:rows])
    for r in (5, 31, 32, 40):
        assert torch.equal(layer(x[r:r + 1]), full[r:r + 1])
    assert layer(x[:0]).shape == (0, 80)  # no rows (a packed forward that keeps no logits)
    assert torch.equal(layer(x.reshape(1, 41, 192))[0], full)  # leading dimensions
    torch.testing.assert_close(full, x @ w.t() + bias, rtol=1e-5, atol=1e-5)  # the same product, other order


def test_the_backend_reads_blocks_where_they_are_and_onednn_elsewhere(tiny_gguf_dir, tiny_dir, caplog):
    t = load_model(str(tiny_gguf_dir))
    with caplog.at_level(logging.INFO, logger="selfspec.kernels"):
        c = t.runner("compact")
    layers = {name: m for _, name, m in linear_layers(c.model)}
    assert all(isinstance(m, CompactLinear) for m in layers.values())
    assert layers["lm_head"].kind == "Q8_0" and layers["q_proj"].kind == "Q4_1"
    assert current_backend(c.model) == "compact" and current_backend(t.model) == "stock"
    assert "22 of 22 linear layers read their GGUF blocks (21 Q4_1, 1 Q8_0" in caplog.text
    ids = torch.tensor([[5, 9, 11, 4, 30, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(c.model(input_ids=ids).logits, t.model(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="selfspec.kernels"):
        plain = load_model(str(tiny_dir)).runner("compact")  # random fp32 weights: no blocks
    assert all(isinstance(m, OneDNNLinear) for _, _, m in linear_layers(plain.model))
    assert "0 of 22 linear layers" in caplog.text and "22 stay fp32 on oneDNN" in caplog.text


def test_compact_needs_fp32(tiny_gguf_dir):
    with pytest.raises(SelfspecError, match="fp32 only"):
        load_model(str(tiny_gguf_dir), dtype="bfloat16", kernels="compact")


def test_without_a_compiler_it_says_what_to_install(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "install g++" in available(torch.device("cpu"), torch.float32)


def test_a_failed_build_is_one_line_naming_another_backend(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.raises(SelfspecError, match=r"building the compact kernel failed .*use --kernels onednn"):
        _build(tmp_path / "compact-test.so")
    assert not (tmp_path / "compact-test.so").exists()


def test_auto_times_compact_instead_of_onednn_where_the_weights_are_blocks(tiny_gguf_dir, tiny_dir):
    from selfspec.kernels.auto import candidates

    assert candidates(load_model(str(tiny_gguf_dir)).model) == ["stock", "compact"]
    assert "compact" not in candidates(load_model(str(tiny_dir)).model)  # random weights: no blocks to read


@pytest.mark.skipif(onednn_available(torch.device("cpu"), torch.float32) is not None, reason="no oneDNN here")
def test_a_server_times_compact_beside_onednn_only_on_its_avx512_build(tiny_gguf_dir, tiny_dir, monkeypatch):
    """On AVX2, compact lost a server's wide batches that a calibration of 4 did not see; its AVX-512
    build won every width measured, so there both are timed."""
    from selfspec.kernels import auto

    blocks, plain = load_model(str(tiny_gguf_dir)).model, load_model(str(tiny_dir)).model
    monkeypatch.setattr(auto, "compact_isa", lambda: "avx512")
    assert auto.batch_candidates(blocks) == ["compact", "onednn"]
    assert auto.batch_candidates(plain) == ["onednn"]  # random weights: no blocks to read
    monkeypatch.setattr(auto, "compact_isa", lambda: "avx2")
    assert auto.batch_candidates(blocks) == ["onednn"]


def test_auto_builds_the_kernel_before_its_clock_starts(tiny_gguf_dir, monkeypatch):
    """The build is a compiler process: timed inside the calibration it would spend the budget and
    make the machine look busy (it did: auto then kept plain decoding)."""
    import selfspec
    import selfspec.autoselect.configure as configure
    from selfspec.kernels import compact

    events: list[str] = []
    real_load, real_choose = compact.load_ops, configure.choose
    monkeypatch.setattr(compact, "load_ops", lambda: (events.append("build"), real_load())[1])

    def choose(*args, **kwargs):
        events.append("clock")
        return real_choose(*args, **kwargs)

    monkeypatch.setattr(configure, "choose", choose)
    g = selfspec.load(str(tiny_gguf_dir), method="pld", kernels="auto", self_test=False, k=3)
    assert events[:2] == ["build", "clock"] and g.kernels in ("stock", "compact")


BUILD_DIGEST = textwrap.dedent("""
    import hashlib, sys, torch
    from torch import nn
    import selfspec.kernels.compact as c
    from tests.conftest import gguf_rounded
    c.isa = lambda: sys.argv[1]  # this process loads that build
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(3)
    digest = hashlib.sha256()
    for kind in ("Q4_1", "Q8_0"):
        lin = nn.Linear(192, 80, bias=False)
        with torch.no_grad():
            lin.weight.copy_(gguf_rounded(torch.randn(80, 192, generator=g) * 0.2, kind))
        c.load_ops()
        layer = c.compact_linear(lin)
        for rows in (1, 3, 6, 7, 12, 13, 40):
            digest.update(layer(torch.randn(rows, 192, generator=g)).numpy().tobytes())
    print(digest.hexdigest())
""")


@pytest.mark.matrix  # builds the AVX2 kernel beside this machine's (half a minute)
@pytest.mark.skipif(NO_COMPACT is not None or isa() != "avx512", reason="needs a CPU with AVX-512")
def test_the_avx512_build_sums_as_the_avx2_build_bit_for_bit():
    """A model's outputs on ``compact`` do not depend on which build the CPU runs: the AVX-512 build's
    products (16-lane registers, up to 12 rows in registers) equal the AVX2 build's bit for bit."""
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    digests = {b: subprocess.run([sys.executable, "-c", BUILD_DIGEST, b], capture_output=True, text=True, check=True,
                                 cwd=root).stdout.split()[-1] for b in ("avx2", "avx512")}
    assert digests["avx2"] == digests["avx512"]
