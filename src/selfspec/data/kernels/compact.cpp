// selfspec's compact-weight products (the `compact` kernels backend, src/selfspec/kernels/compact.py).
//
// Each weight is read as the GGUF block it came from and decompressed in registers to the fp32
// value the model's fp32 copy holds, bit for bit:
//   Q4_1: 32 weights a block, 4-bit codes q (element i in the low nibble of byte i, element i + 16
//         in the high one), fp16 constants d and m (passed as fp32): w = fma(q, d, m), which is
//         fl32(d * q + m) exactly (d * q needs at most 15 significant bits);
//   Q8_0: 32 int8 codes a block and one fp16 constant d: w = q * d, exact (19 bits at most).
// Products are fp32: out[r, n] = sum_k x[r, k] * w[n, k], summed in one fixed order (four 8-lane
// accumulators over the blocks, then a fixed horizontal sum). Every row r runs the same operations
// in the same order whatever the number of rows, so a row's result does not depend on the block
// it came in (the row invariance batching and tree verification rely on).
//
// Built once per machine by compact.py (g++ -O3 -mavx2 -mfma -fopenmp) and loaded with
// torch.ops.load_library; the ops live in namespace selfspec_compact.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

inline float hsum(__m256 v) {  // a fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7))
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// one block's 32 weights, decompressed: w[0..3] hold elements 0-7, 8-15, 16-23, 24-31
inline void q4_1_block(const uint8_t* codes, float d, float m, __m256 w[4]) {
    const __m128i low = _mm_set1_epi8(15);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i lo = _mm_and_si128(b, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, mv);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, mv);
}

inline void q8_0_block(const int8_t* codes, float d, __m256 w[4]) {
    const __m256 dv = _mm256_set1_ps(d);
    for (int j = 0; j < 4; ++j) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * j));
        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), dv);
    }
}

// the sum of row x[0..K) against the decompressed weights, in the one fixed order every row uses
template <typename Weights>
inline float dot(const float* x, int64_t G, Weights weights) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 w[4];
    for (int64_t g = 0; g < G; ++g) {
        weights(g, w);
        const float* xg = x + g * 32;
        a0 = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), a0);
        a1 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), a1);
        a2 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), a2);
        a3 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), a3);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// dot for two rows at once over the same decompressed weights (in B): each row's accumulators and
// operations are dot's, interleaved so that the two rows' multiply-adds overlap
inline void dot2(const float* x, const float* y, const float* B, int64_t G, float* ox, float* oy) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        const float* w = B + g * 32;
        const float* xg = x + g * 32;
        const float* yg = y + g * 32;
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        const __m256 w2 = _mm256_loadu_ps(w + 16), w3 = _mm256_loadu_ps(w + 24);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg), a0);
        b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(yg), b0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), a1);
        b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(yg + 8), b1);
        a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), a2);
        b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(yg + 16), b2);
        a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), a3);
        b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(yg + 24), b3);
    }
    *ox = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    *oy = hsum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
}

// out[M, N] = x[M, K] @ W.T, W's row n decompressed block by block by `block(n, g, w)`. One row
// (a decode step) decompresses in registers; several rows (a verify block, a batch) decompress a
// weight row once into a buffer and run each row's sum over it: the same weights, the same
// operations in the same order (dot), so each row's result is the same as alone, bit for bit.
constexpr int64_t ROWS = 8;

template <typename Block>
void product(const float* X, float* O, int64_t M, int64_t K, int64_t N, Block block) {
    const int64_t G = K / 32;
    at::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
        std::vector<float> buf(M > 1 ? static_cast<size_t>(K) : 0);
        for (int64_t n = n0; M == 1 && n < n1; ++n) {
            O[n] = dot(X, G, [&](int64_t g, __m256 w[4]) { block(n, g, w); });
        }
        if (M == 1) return;
        // tiles of ROWS rows, so their x stays in the L1 cache across the weight rows
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int64_t r1 = std::min(M, r0 + ROWS);
            for (int64_t n = n0; n < n1; ++n) {
                __m256 w[4];
                for (int64_t g = 0; g < G; ++g) {
                    block(n, g, w);
                    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(buf.data() + g * 32 + 8 * j, w[j]);
                }
                const float* B = buf.data();
                int64_t r = r0;
                for (; r + 1 < r1; r += 2) dot2(X + r * K, X + (r + 1) * K, B, G, O + r * N + n, O + (r + 1) * N + n);
                if (r < r1) {
                    O[r * N + n] = dot(X + r * K, G, [&](int64_t g, __m256 v[4]) {
                        for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(B + g * 32 + 8 * j);
                    });
                }
            }
        }
    });
}

void check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, int64_t bytes_per_block) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                "x must be a contiguous fp32 CPU matrix [M, K]");
    const int64_t K = x.size(1);
    TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
    TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == K / 32 * bytes_per_block,
                "codes must be contiguous [N, K / 32 * ", bytes_per_block, "]");
    TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.size(0) == codes.size(0) &&
                d.size(1) == K / 32, "d must be contiguous fp32 [N, K / 32]");
}

// x [M, K] fp32, codes [N, K / 2] uint8, d and m [N, K / 32] fp32 -> [M, N]
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
    check(x, codes, d, 16);
    TORCH_CHECK(codes.scalar_type() == at::kByte && m.sizes() == d.sizes() && m.is_contiguous() &&
                m.scalar_type() == at::kFloat, "Q4_1: uint8 codes, fp32 m shaped as d");
    const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / 32;
    auto out = at::empty({M, N}, x.options());
    const uint8_t* C = codes.data_ptr<uint8_t>();
    const float* D = d.data_ptr<float>();
    const float* Mn = m.data_ptr<float>();
    product(x.data_ptr<float>(), out.data_ptr<float>(), M, K, N, [&](int64_t n, int64_t g, __m256 w[4]) {
        q4_1_block(C + n * (K / 2) + g * 16, D[n * G + g], Mn[n * G + g], w);
    });
    return out;
}

// x [M, K] fp32, codes [N, K] int8, d [N, K / 32] fp32 -> [M, N]
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
    check(x, codes, d, 32);
    TORCH_CHECK(codes.scalar_type() == at::kChar, "Q8_0: int8 codes");
    const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / 32;
    auto out = at::empty({M, N}, x.options());
    const int8_t* C = codes.data_ptr<int8_t>();
    const float* D = d.data_ptr<float>();
    product(x.data_ptr<float>(), out.data_ptr<float>(), M, K, N, [&](int64_t n, int64_t g, __m256 w[4]) {
        q8_0_block(C + n * K + g * 32, D[n * G + g], w);
    });
    return out;
}

}  // namespace

TORCH_LIBRARY(selfspec_compact, lib) {
    lib.def("q4_1_linear(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
    lib.def("q8_0_linear(Tensor x, Tensor codes, Tensor d) -> Tensor");
}

TORCH_LIBRARY_IMPL(selfspec_compact, CPU, lib) {
    lib.impl("q4_1_linear", &q4_1_linear);
    lib.impl("q8_0_linear", &q8_0_linear);
}
