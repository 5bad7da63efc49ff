"""A hand-written Q4_1 product that decompresses in registers and multiplies in fp32 (issue 62, route 2).

``experiments/packed_q4_gemv.py`` found Inductor's fused loops slower on packed codes than on fp32
weights (it vectorises the byte loads as partial loads, and splits the decompression out of the
reduction). This one is a C++ kernel (AVX2 + FMA intrinsics, built with ``torch.utils.cpp_extension``
on first use) over the GGUF block layout itself: per output row, per 32-weight block, 16 bytes of codes
(element ``i`` in the low nibble of byte ``i``, element ``i + 16`` in the high one) and the block's
``d`` and ``m``. Each weight is ``fma(q, d, m)``, which is ``fl32(d * q + m)`` exactly (``d * q`` needs at
most 15 significant bits), so the product reads the same weights as the fp32 copy; only the order of
the sum differs. Each row of ``x`` runs its own loop in the same order, so a row's result does not depend
on how many rows are in the block (the row invariance batching and tree verification need; checked).

It times one decode step's linear products of SmolLM2-135M (30 layers of q/k/v/o/gate/up/down, one
token; attention and the LM head left out) against the fp32 reduction the ``compiled`` backend
generates (``kernels/gemv.py``) and oneDNN's fp32 product, interleaved in one process.

    python experiments/packed_q4_kernel.py --out docs/results/packed-q4-kernel-avx2-1130
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from packed_q4_gemv import GROUP, q4_1_blocks, run_args, write_run  # noqa: E402

from selfspec.kernels.gemv import blocked, gemv  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {  // a fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7))
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// x [M, K] fp32, codes [N, K / 2] uint8 (GGUF Q4_1 order), d and m [N, K / 32] fp32 -> [M, N]
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
    const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / 32;
    auto out = torch::empty({M, N}, x.options());
    const float* X = x.data_ptr<float>();
    const uint8_t* C = codes.data_ptr<uint8_t>();
    const float* D = d.data_ptr<float>();
    const float* Mn = m.data_ptr<float>();
    float* O = out.data_ptr<float>();
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
        const __m128i low = _mm_set1_epi8(15);
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* cn = C + n * (K / 2);
            for (int64_t r = 0; r < M; ++r) {
                const float* xr = X + r * K;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
                for (int64_t g = 0; g < G; ++g) {
                    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cn + g * 16));
                    const __m128i lo = _mm_and_si128(b, low);
                    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
                    const __m256 dv = _mm256_set1_ps(D[n * G + g]), mv = _mm256_set1_ps(Mn[n * G + g]);
                    const float* xg = xr + g * 32;
                    __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv);
                    const __m128i lo8 = _mm_srli_si128(lo, 8), hi8 = _mm_srli_si128(hi, 8);
                    __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo8)), dv, mv);
                    __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv);
                    __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi8)), dv, mv);
                    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg), a0);
                    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), a1);
                    a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), a2);
                    a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), a3);
                }
                O[r * N + n] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            }
        }
    });
    return out;
}

// the weights the kernel reads, decompressed the same way: [N, K]
torch::Tensor q4_1_weights(torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
    const int64_t N = codes.size(0), K = codes.size(1) * 2, G = K / 32;
    auto w = torch::empty({N, K}, d.options());
    const uint8_t* C = codes.data_ptr<uint8_t>();
    float* W = w.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n)
        for (int64_t g = 0; g < G; ++g)
            for (int i = 0; i < 16; ++i) {
                const uint8_t b = C[n * (K / 2) + g * 16 + i];
                const float dd = d.data_ptr<float>()[n * G + g], mm = m.data_ptr<float>()[n * G + g];
                W[n * K + g * 32 + i] = std::fma(float(b & 15), dd, mm);
                W[n * K + g * 32 + i + 16] = std::fma(float(b >> 4), dd, mm);
            }
    return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
    mod.def("q4_1_linear", &q4_1_linear);
    mod.def("q4_1_weights", &q4_1_weights);
}
"""


def build():
    """The extension, compiled on first use (g++, ``-O3 -mavx2 -mfma``; about a minute)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline("selfspec_q4_1_probe", cpp_sources=SOURCE, extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], verbose=False)


def gguf_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q[N, K]`` (0..15) packed as GGUF Q4_1 does: ``[N, K / 2]`` uint8, per 32-weight block
    16 bytes, element ``i`` in the low nibble of byte ``i`` and element ``i + 16`` in the high one."""
    n, k = q.shape
    g = q.reshape(n, k // GROUP, GROUP)
    return (g[..., :16] | (g[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def main() -> None:
    args = run_args(__doc__)
    from selfspec.models import bundled
    from selfspec.models.loading import load_model

    t = time.perf_counter()
    ext = build()
    build_s = time.perf_counter() - t
    model = load_model(str(bundled.pull(args.model))).model
    linears = [mod for blk in model.model.layers for mod in (
        blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj, blk.self_attn.o_proj,
        blk.mlp.gate_proj, blk.mlp.up_proj, blk.mlp.down_proj)]
    packed, fp32_blocked, fp32_onednn, exact, invariant, worst = [], [], [], True, True, 0.0
    g = torch.Generator().manual_seed(0)
    for mod in linears:
        w = mod.weight.detach().float().contiguous()
        blocks = q4_1_blocks(w)
        if blocks is None:
            raise SystemExit(f"{mod} is not Q4_1 blocks")
        q, d, m = blocks
        p = (gguf_codes(q), d.contiguous(), m.contiguous())
        exact &= torch.equal(ext.q4_1_weights(*p), w)
        x8 = torch.randn(8, w.shape[1], generator=g)
        y8 = ext.q4_1_linear(x8, *p)
        invariant &= all(torch.equal(ext.q4_1_linear(x8[:r], *p), y8[:r]) for r in (1, 2, 5))
        worst = max(worst, float((y8 - x8 @ w.t()).abs().max() / (x8 @ w.t()).abs().max()))
        packed.append(p)
        fp32_blocked.append(blocked(w))
        fp32_onednn.append(torch.ops.mkldnn._reorder_linear_weight(w))
    print(f"built in {build_s:.0f} s; weights read = fp32 weights bit for bit: {exact}; rows invariant to the "
          f"block's size: {invariant}; largest relative difference from fp32 x @ W.T: {worst:.1e}")

    compiled_gemv = torch.compile(gemv, dynamic=False)
    x = torch.randn(1, linears[0].in_features, generator=g)
    xd = torch.randn(1, linears[6].in_features, generator=g)

    def inputs(i: int) -> torch.Tensor:
        return xd if i % 7 == 6 else x

    cases = {
        "q4_1 kernel (packed, 0.56 B/weight)": lambda: [ext.q4_1_linear(inputs(i), *p) for i, p in enumerate(packed)],
        "fp32 compiled reduction (4 B/weight)": lambda: [compiled_gemv(inputs(i), wb)
                                                         for i, wb in enumerate(fp32_blocked)],
        "fp32 oneDNN (4 B/weight)": lambda: [torch.ops.mkldnn._linear_pointwise(inputs(i), wp, None, "none", [], "")
                                             for i, wp in enumerate(fp32_onednn)],
    }
    for fn in cases.values():  # compile, warm
        fn()
        fn()
    runs: dict[str, list[float]] = {n: [] for n in cases}
    for _ in range(args.repeats):
        for n, fn in cases.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                fn()
            runs[n].append((time.perf_counter() - t) / args.steps * 1e3)
    n_weights = sum(mod.weight.numel() for mod in linears)
    med = {n: statistics.median(r) for n, r in runs.items()}
    base = med["fp32 compiled reduction (4 B/weight)"]
    rows = {}
    for n, ms in med.items():
        per = 0.5 + 8 / GROUP if n.startswith("q4_1") else 4.0
        rows[n] = {"ms_per_step": round(ms, 3), "vs_fp32_compiled": round(base / ms, 2),
                   "GB_per_s": round(n_weights * per / ms / 1e6, 1), "runs_ms": [round(r, 3) for r in runs[n]]}
        print(f"{n:40s} {ms:7.2f} ms per step of 210 products  {base / ms:5.2f}x fp32 compiled  "
              f"{rows[n]['GB_per_s']:5.1f} GB/s")
    write_run("packed_q4_kernel.py", args, {
        "weights_exact": exact, "rows_invariant": invariant, "max_rel_diff_vs_fp32": worst,
        "build_s": round(build_s, 1), "products": len(linears), "weights": n_weights, "stores": rows})


if __name__ == "__main__":
    main()
