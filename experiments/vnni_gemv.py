"""Would a native int8 product pay in the draft step? (issue 34: the int8 draft's products run at 41
GB/s in Inductor's loop, bound by converting int8 to fp32; ``experiments/draft_step_limits.py``)

A one-row int8 product written with AVX512-VNNI dot products (activations quantised per token to
unsigned 8 bits, ``vpdpbusd`` over weights laid out as ``[N / 16, K / 4, 16, 4]``, four output blocks per
loop, ``at::parallel_for`` over blocks), built with ``torch.utils.cpp_extension.load_inline`` (g++ and
ninja, about 30 s), timed on SmolLM2's LM head alone and on all 121 products of a step plus the head,
called one by one as a compiled graph would call an operator. AVX512-VNNI CPUs only; an experiment, not
a kernel the library ships (it would be a native extension built on the user's machine).

    python experiments/vnni_gemv.py [BUILD_DIR]
"""

import statistics
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

SRC = r'''
#include <torch/extension.h>
#include <immintrin.h>
#include <ATen/Parallel.h>
// w: [N/16, K/4, 16, 4] int8 (as int32 [N/16, K/4, 16]); wsum: [N] int32; scale: [N] float
torch::Tensor gemv_vnni(torch::Tensor x, torch::Tensor w, torch::Tensor wsum, torch::Tensor scale) {
  const int64_t K = x.size(1);
  const int64_t NB = w.size(0);
  const int64_t G = K / 4;
  auto out = torch::empty({1, NB * 16}, x.options());
  // quantize x per token: u8 = round(x / s) + 128
  const float* xp = x.data_ptr<float>();
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xp[k]));
  const float s = amax > 0 ? amax / 127.f : 1.f;
  const float inv = 1.f / s;
  std::vector<uint8_t> xq(K);
  for (int64_t k = 0; k < K; ++k) xq[k] = (uint8_t)(int)(std::nearbyint(xp[k] * inv) + 128);
  const int32_t* xq32 = reinterpret_cast<const int32_t*>(xq.data());
  const int32_t* wp = w.data_ptr<int32_t>();
  const int32_t* ws = wsum.data_ptr<int32_t>();
  const float* sc = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
    for (; b + 4 <= b1; b += 4) {
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      __m512i a2 = _mm512_setzero_si512(), a3 = _mm512_setzero_si512();
      const int32_t* p0 = wp + (b + 0) * G * 16; const int32_t* p1 = wp + (b + 1) * G * 16;
      const int32_t* p2 = wp + (b + 2) * G * 16; const int32_t* p3 = wp + (b + 3) * G * 16;
      for (int64_t g = 0; g < G; ++g) {
        __m512i xb = _mm512_set1_epi32(xq32[g]);
        a0 = _mm512_dpbusd_epi32(a0, xb, _mm512_loadu_si512(p0 + g * 16));
        a1 = _mm512_dpbusd_epi32(a1, xb, _mm512_loadu_si512(p1 + g * 16));
        a2 = _mm512_dpbusd_epi32(a2, xb, _mm512_loadu_si512(p2 + g * 16));
        a3 = _mm512_dpbusd_epi32(a3, xb, _mm512_loadu_si512(p3 + g * 16));
      }
      __m512i accs[4] = {a0, a1, a2, a3};
      for (int j = 0; j < 4; ++j) {
        int64_t n0 = (b + j) * 16;
        __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(ws + n0), 7);
        __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(accs[j], corr));
        v = _mm512_mul_ps(v, _mm512_mul_ps(_mm512_loadu_ps(sc + n0), _mm512_set1_ps(s)));
        _mm512_storeu_ps(op + n0, v);
      }
    }
    for (; b < b1; ++b) {
      __m512i a0 = _mm512_setzero_si512();
      const int32_t* p0 = wp + b * G * 16;
      for (int64_t g = 0; g < G; ++g)
        a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(xq32[g]), _mm512_loadu_si512(p0 + g * 16));
      int64_t n0 = b * 16;
      __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(ws + n0), 7);
      __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(a0, corr));
      _mm512_storeu_ps(op + n0, _mm512_mul_ps(v, _mm512_mul_ps(_mm512_loadu_ps(sc + n0), _mm512_set1_ps(s))));
    }
  });
  return out;
}
'''


mod = load_inline("vnni_gemv_exp", cpp_sources=[SRC], functions=["gemv_vnni"],
                  extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-fopenmp"], verbose=False,
                  build_directory=sys.argv[1] if len(sys.argv) > 1 else None)

def pack(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q[N, K]`` int8 as ``[N / 16, K / 4, 16]`` int32 (16 outputs x 4 inputs per 64 bytes), and its row sums."""
    n, k = q.shape
    w = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()  # [N/16, K/4, 16, 4]
    return w.view(torch.int32).reshape(n // 16, k // 4, 16), q.to(torch.int32).sum(1).to(torch.int32).contiguous()



torch.manual_seed(0)
shapes = [(960,576),(576,576),(3072,576),(576,1536)]*30 + [(49152,576)]
Q = [torch.randint(-127,128,s,dtype=torch.int8) for s in shapes]
W = [pack(q) + (torch.rand(q.shape[0]),) for q in Q]
xs = {576: torch.randn(1,576), 1536: torch.randn(1,1536)}
# check
q, (w, ws, sc) = Q[2], W[2]
y = mod.gemv_vnni(xs[576], w, ws, sc)
ref = xs[576] @ (q.float() * sc[:, None]).T
print("rel err vs fp32 (activation rounding)", float((y - ref).abs().max() / ref.abs().max()))


def run(sub: list) -> None:
    for w, ws, sc in sub:
        mod.gemv_vnni(xs[w.shape[1] * 4], w, ws, sc)

mb_all = sum(q.numel() for q in Q) / 1e6
for name, sub, mb in (("lm_head", W[-1:], Q[-1].numel()/1e6), ("all", W, mb_all)):
    for _ in range(5):
        run(sub)
    ts = []
    for _ in range(30):
        t = time.perf_counter()
        run(sub)
        ts.append(time.perf_counter() - t)
    m = statistics.median(ts)
    print(name, f"{m * 1e3:.3f} ms {mb / m / 1e3:.1f} GB/s", flush=True)
