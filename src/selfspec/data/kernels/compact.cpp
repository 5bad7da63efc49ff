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
// Built once per machine by compact.py (g++ -O3 -mavx2 -mfma -fopenmp, and -mavx512f where the CPU
// has AVX-512) and loaded with torch.ops.load_library; the ops live in namespace selfspec_compact.
// With AVX-512 the rows that decompress in registers (`dots`) hold two of the 8-lane accumulators in
// one 16-lane register (lanes 0-7: a_0 or a_2, lanes 8-15: a_1 or a_3) and decompress a block in two
// 16-lane halves: every lane runs the same multiply-adds in the same order as with AVX2, so the sums,
// and the model's outputs, are the AVX2 build's bit for bit, at about half the instructions.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

#define ALWAYS_INLINE inline __attribute__((always_inline))  // the decompression must fuse into the sums

ALWAYS_INLINE float hsum(__m256 v) {  // a fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7))
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// one block's 32 weights, decompressed: w[0..3] hold elements 0-7, 8-15, 16-23, 24-31
ALWAYS_INLINE void q4_1_block(const uint8_t* codes, float d, float m, __m256 w[4]) {
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

ALWAYS_INLINE void q8_0_block(const int8_t* codes, float d, __m256 w[4]) {
    const __m256 dv = _mm256_set1_ps(d);
    for (int j = 0; j < 4; ++j) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * j));
        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), dv);
    }
}

#ifdef __AVX512F__
// one block's 32 weights in two 16-lane halves: w[0] holds elements 0-15 (q4_1_block's w[0], w[1]),
// w[1] elements 16-31 (its w[2], w[3]); the same fma per element
ALWAYS_INLINE void q4_1_block16(const uint8_t* codes, float d, float m, __m512 w[2]) {
    const __m128i low = _mm_set1_epi8(15);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low))), dv, mv);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low))), dv, mv);
}

ALWAYS_INLINE void q8_0_block16(const int8_t* codes, float d, __m512 w[2]) {
    const __m512 dv = _mm512_set1_ps(d);
    for (int j = 0; j < 2; ++j) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * j));
        w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), dv);
    }
}

ALWAYS_INLINE __m256 low8(__m512 v) { return _mm512_castps512_ps256(v); }
ALWAYS_INLINE __m256 high8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// `dots` with 16-lane registers: a[r][0] holds a_0 | a_1 and a[r][1] a_2 | a_3, lane for lane the
// same multiply-adds; then ((a_0 + a_1) + (a_2 + a_3)) and the same horizontal sum
template <int R, typename Weights>
ALWAYS_INLINE void dots16(const float* x, int64_t K, int64_t G, Weights weights, float* out, int64_t N) {
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    __m512 w[2];
    for (int64_t g = 0; g < G; ++g) {
        weights(g, w);
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 2; ++j) a[r][j] = _mm512_fmadd_ps(w[j], _mm512_loadu_ps(x + r * K + g * 32 + 16 * j), a[r][j]);
    }
    for (int r = 0; r < R; ++r)
        out[r * N] = hsum(_mm256_add_ps(_mm256_add_ps(low8(a[r][0]), high8(a[r][0])),
                                        _mm256_add_ps(low8(a[r][1]), high8(a[r][1]))));
}
#endif

// the sums of R rows x[r * K ..] against one weight row, decompressed block by block in registers
// by `weights(g, w)`, into out[r * N]: every row in the one fixed order (four 8-lane accumulators a_j
// over the blocks, lanes 8 j .. 8 j + 7 of each; then ((a_0 + a_1) + (a_2 + a_3)) and a fixed
// horizontal sum), whatever R is
template <int R, typename Weights>
ALWAYS_INLINE void dots(const float* x, int64_t K, int64_t G, Weights weights, float* out, int64_t N) {
    __m256 a[R][4];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) a[r][j] = _mm256_setzero_ps();
    __m256 w[4];
    for (int64_t g = 0; g < G; ++g) {
        weights(g, w);
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 4; ++j) a[r][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + r * K + g * 32 + 8 * j), a[r][j]);
    }
    for (int r = 0; r < R; ++r)
        out[r * N] = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
}

// More rows (a verify block, a batch, a prompt's chunk) run the same sums as `dots`, tiled so that
// each load serves several multiply-adds. The rows are first laid out lane-major (row r's [j][g][0..8)
// holds x[r, 32 g + 8 j .. +8), the j-th 8 lanes of block g), and so is a tile of decompressed weight
// rows. Then for each j, a tile of R x C accumulators runs over the blocks g in order,
// acc[r][c] = fma(w[c], x[r], acc[r][c]): each lane is exactly the accumulator a_j of `dots`, and the four are
// added as `dots` adds them. So every row's result is its one-row result, bit for bit.
constexpr int64_t TR = 4;   // rows in a register tile
constexpr int64_t TC = 3;   // weight rows in a register tile (4 x 3 accumulators, 3 weights, 1 row: 16 registers)
constexpr int64_t MB = 32;  // rows one pass over a weight tile reads (their lane-major copy stays in L2)

inline void to_lanes(const float* x, int64_t G, float* out) {  // [K] -> [4][G][8]
    for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + (j * G + g) * 8, _mm256_loadu_ps(x + g * 32 + 8 * j));
}

// out[r * N + c] for R lane-major rows of X and C lane-major weight rows of W (each K floats apart)
template <int R, int C>
inline void tile(const float* X, const float* W, int64_t G, float* out, int64_t N) {
    const int64_t K = G * 32;
    __m256 part[4][R][C];
    for (int j = 0; j < 4; ++j) {
        __m256 acc[R][C];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
        const float* Xj = X + j * G * 8;
        const float* Wj = W + j * G * 8;
        for (int64_t g = 0; g < G; ++g) {
            __m256 w[C];
            for (int c = 0; c < C; ++c) w[c] = _mm256_loadu_ps(Wj + c * K + g * 8);
            for (int r = 0; r < R; ++r) {
                const __m256 xv = _mm256_loadu_ps(Xj + r * K + g * 8);
                for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(w[c], xv, acc[r][c]);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) part[j][r][c] = acc[r][c];
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            out[r * N + c] = hsum(_mm256_add_ps(_mm256_add_ps(part[0][r][c], part[1][r][c]),
                                                _mm256_add_ps(part[2][r][c], part[3][r][c])));
}

template <int C>
inline void tiles(const float* X, const float* W, int64_t rows, int64_t G, float* out, int64_t N) {
    const int64_t K = G * 32;
    int64_t r = 0;
    for (; r + TR <= rows; r += TR) tile<TR, C>(X + r * K, W, G, out + r * N, N);
    switch (rows - r) {
        case 3: tile<3, C>(X + r * K, W, G, out + r * N, N); break;
        case 2: tile<2, C>(X + r * K, W, G, out + r * N, N); break;
        case 1: tile<1, C>(X + r * K, W, G, out + r * N, N); break;
        default: break;
    }
}

// out[M, N] = x[M, K] @ W.T, W's row n decompressed block by block by `block(n, g, w)`. Up to six
// rows (twelve with AVX-512: a decode step, a verify block, a small batch) decompress in registers (`dots`); more rows decompress
// TC weight rows at a time into a lane-major buffer and run the tiles above over it: the same
// operations in the same order, so each row's result is the same as alone, bit for bit.
template <typename Block, typename Block16>
void product(const float* X, float* O, int64_t M, int64_t K, int64_t N, Block block, Block16 block16) {
    if (M == 0) return;  // no rows (a packed forward that keeps no logits)
    const int64_t G = K / 32;
#ifdef __AVX512F__
    constexpr int64_t IN_REGISTERS = 12;  // 24 accumulators of the 32 registers (single layer, 2-core Xeon: 7 rows
                                          // tiled 500 us, 6 in registers 200 us)
#else
    constexpr int64_t IN_REGISTERS = 6;  // more accumulators spill (measured: 7 and 8 rows tile faster)
#endif
    std::vector<float> lanes(M > IN_REGISTERS ? static_cast<size_t>(M * K) : 0);
    if (M > IN_REGISTERS) {
        at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r) to_lanes(X + r * K, G, lanes.data() + r * K);
        });
    }
    at::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
        if (M <= IN_REGISTERS) {
            for (int64_t n = n0; n < n1; ++n) {
#ifdef __AVX512F__
                (void)block;
                auto weights = [&](int64_t g, __m512 w[2]) __attribute__((always_inline)) { block16(n, g, w); };
#define DOTS dots16
#else
                (void)block16;
                auto weights = [&](int64_t g, __m256 w[4]) __attribute__((always_inline)) { block(n, g, w); };
#define DOTS dots
#endif
                switch (M) {
                    case 1: DOTS<1>(X, K, G, weights, O + n, N); break;
                    case 2: DOTS<2>(X, K, G, weights, O + n, N); break;
                    case 3: DOTS<3>(X, K, G, weights, O + n, N); break;
                    case 4: DOTS<4>(X, K, G, weights, O + n, N); break;
                    case 5: DOTS<5>(X, K, G, weights, O + n, N); break;
#ifdef __AVX512F__
                    case 6: DOTS<6>(X, K, G, weights, O + n, N); break;
                    case 7: DOTS<7>(X, K, G, weights, O + n, N); break;
                    case 8: DOTS<8>(X, K, G, weights, O + n, N); break;
                    case 9: DOTS<9>(X, K, G, weights, O + n, N); break;
                    case 10: DOTS<10>(X, K, G, weights, O + n, N); break;
                    case 11: DOTS<11>(X, K, G, weights, O + n, N); break;
                    default: DOTS<12>(X, K, G, weights, O + n, N); break;
#else
                    default: DOTS<6>(X, K, G, weights, O + n, N); break;
#endif
                }
#undef DOTS
            }
            return;
        }
        std::vector<float> buf(static_cast<size_t>(TC * K));
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t rows = std::min(MB, M - m0);
            for (int64_t c0 = n0; c0 < n1; c0 += TC) {
                const int64_t C = std::min(TC, n1 - c0);
                for (int64_t c = 0; c < C; ++c) {
                    __m256 w[4];
                    float* Wc = buf.data() + c * K;
                    for (int64_t g = 0; g < G; ++g) {
                        block(c0 + c, g, w);
                        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(Wc + (j * G + g) * 8, w[j]);
                    }
                }
                const float* Xm = lanes.data() + m0 * K;
                float* Om = O + m0 * N + c0;
                if (C == 3) tiles<3>(Xm, buf.data(), rows, G, Om, N);
                else if (C == 2) tiles<2>(Xm, buf.data(), rows, G, Om, N);
                else tiles<1>(Xm, buf.data(), rows, G, Om, N);
            }
        }
    });
}

#ifdef __AVX512F__
using Wide = __m512*;  // a block in two 16-lane halves (q4_1_block16, q8_0_block16)
ALWAYS_INLINE void q4_1_wide(const uint8_t* c, float d, float m, Wide w) { q4_1_block16(c, d, m, w); }
ALWAYS_INLINE void q8_0_wide(const int8_t* c, float d, Wide w) { q8_0_block16(c, d, w); }
#else
using Wide = void*;  // no 16-lane registers: the 8-lane blocks serve every row
ALWAYS_INLINE void q4_1_wide(const uint8_t*, float, float, Wide) {}
ALWAYS_INLINE void q8_0_wide(const int8_t*, float, Wide) {}
#endif

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
    product(x.data_ptr<float>(), out.data_ptr<float>(), M, K, N, [&](int64_t n, int64_t g, __m256 w[4]) __attribute__((always_inline)) {
        q4_1_block(C + n * (K / 2) + g * 16, D[n * G + g], Mn[n * G + g], w);
    }, [&](int64_t n, int64_t g, Wide w) __attribute__((always_inline)) {
        q4_1_wide(C + n * (K / 2) + g * 16, D[n * G + g], Mn[n * G + g], w);
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
    product(x.data_ptr<float>(), out.data_ptr<float>(), M, K, N, [&](int64_t n, int64_t g, __m256 w[4]) __attribute__((always_inline)) {
        q8_0_block(C + n * K + g * 32, D[n * G + g], w);
    }, [&](int64_t n, int64_t g, Wide w) __attribute__((always_inline)) {
        q8_0_wide(C + n * K + g * 32, D[n * G + g], w);
    });
    return out;
}

// ---- one-token attention (kernels/token_attention.py) ----
// One query token of each of R requests against that request's own cached keys and values:
// out[r, h] = sum_i p_i v_i / sum_i p_i, p_i = exp(s_i - max s), s_i = scale * (q[r, h] . k_i), over
// the request's L_r positions of its KV head h / (Hq / Hkv). Each (request, head) runs on one thread
// in one fixed order that depends only on its own D and L_r, so a request's result is the same bit
// for bit alone or beside any others, on any number of threads (a batch step and a solo step agree).
// 8-lane AVX2 only: the AVX-512 build runs the same instructions.

// exp(x) for x <= 0, lane by lane (Cephes' expf: a degree-6 polynomial on x - n ln 2, times 2^n);
// within 2 ulp of the true value for x >= -87, and the same value for the same input in any lane
ALWAYS_INLINE __m256 exp_le0(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// out[0 .. 8 N) = inv * sum_j p[j] v[j * vs + 0 .. 8 N), each 8 lanes summed over j in order
template <int N>
ALWAYS_INLINE void weigh(const float* p, const float* v, int64_t vs, int64_t L, float inv, float* out) {
    __m256 a[N];
    for (int t = 0; t < N; ++t) a[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int t = 0; t < N; ++t) a[t] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * vs + 8 * t), a[t]);
    }
    for (int t = 0; t < N; ++t) _mm256_storeu_ps(out + 8 * t, _mm256_mul_ps(a[t], _mm256_set1_ps(inv)));
}

// one (request, head): q[D], keys and values at k + i * ks, v + i * vs (i < L, D contiguous floats
// each), D a multiple of 8; scores: scratch for ceil(L / 8) * 8 floats; out[D]
void attend_one(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t L, int64_t D,
                float scale, float* scores, float* out) {
    const int64_t L8 = (L + 7) / 8 * 8;
    float top = -INFINITY;
    int64_t i = 0;
    for (; i + 8 <= L; i += 8) {  // eight keys at once: independent sums, each in the one-key order
        __m256 a[8];
        for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (i + t) * ks + d), a[t]);
        }
        for (int t = 0; t < 8; ++t) scores[i + t] = hsum(a[t]) * scale;
    }
    for (; i < L; ++i) {
        __m256 a0 = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + i * ks + d), a0);
        scores[i] = hsum(a0) * scale;
    }
    for (int64_t j = 0; j < L; ++j) top = std::max(top, scores[j]);
    for (int64_t j = L; j < L8; ++j) scores[j] = top;  // finite scratch past L (weighed 0 below)
    const __m256 mv = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < L8; j += 8) {
        __m256 p = exp_le0(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
        if (j + 8 > L) {  // the positions past L weigh nothing
            alignas(32) float keep[8];
            for (int t = 0; t < 8; ++t) keep[t] = j + t < L ? 1.0f : 0.0f;
            p = _mm256_mul_ps(p, _mm256_load_ps(keep));
        }
        _mm256_storeu_ps(scores + j, p);
        total = _mm256_add_ps(total, p);
    }
    const float inv = 1.0f / hsum(total);
    for (int64_t d = 0; d < D; d += 64) {  // up to eight 8-lane sums over the positions at once
        switch (std::min<int64_t>(8, (D - d) / 8)) {
            case 8: weigh<8>(scores, v + d, vs, L, inv, out + d); break;
            case 7: weigh<7>(scores, v + d, vs, L, inv, out + d); break;
            case 6: weigh<6>(scores, v + d, vs, L, inv, out + d); break;
            case 5: weigh<5>(scores, v + d, vs, L, inv, out + d); break;
            case 4: weigh<4>(scores, v + d, vs, L, inv, out + d); break;
            case 3: weigh<3>(scores, v + d, vs, L, inv, out + d); break;
            case 2: weigh<2>(scores, v + d, vs, L, inv, out + d); break;
            default: weigh<1>(scores, v + d, vs, L, inv, out + d); break;
        }
    }
}

// q [R, Hq, D] fp32; keys[r], values[r] [1, Hkv, L_r, D] fp32 (D contiguous); -> [R, Hq, D]
at::Tensor decode_attention(const at::Tensor& q, at::TensorList keys, at::TensorList values, double scale) {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(),
                "q must be a contiguous fp32 CPU tensor [R, Hq, D]");
    const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2);
    TORCH_CHECK(D % 8 == 0, "head size must be a multiple of 8");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == R && static_cast<int64_t>(values.size()) == R,
                "one key and one value tensor per query row");
    int64_t Hkv = 0;
    for (int64_t r = 0; r < R; ++r) {
        const at::Tensor& k = keys[r];
        const at::Tensor& v = values[r];
        TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && k.size(3) == D && k.stride(3) == 1 && k.scalar_type() == at::kFloat &&
                    v.sizes() == k.sizes() && v.stride(3) == 1 && v.scalar_type() == at::kFloat,
                    "keys and values must be fp32 [1, Hkv, L, D] with D contiguous");
        TORCH_CHECK(r == 0 || k.size(1) == Hkv, "every request has the same KV heads");
        TORCH_CHECK(k.size(2) > 0, "a query row needs at least one position to attend to");
        Hkv = k.size(1);
    }
    TORCH_CHECK(R == 0 || Hq % Hkv == 0, "query heads must be a multiple of KV heads");
    auto out = at::empty({R, Hq, D}, q.options());
    const float* Q = q.data_ptr<float>();
    float* O = out.data_ptr<float>();
    const float s = static_cast<float>(scale);
    at::parallel_for(0, R * Hq, 1, [&](int64_t b, int64_t e) {
        std::vector<float> scores;
        for (int64_t t = b; t < e; ++t) {
            const int64_t r = t / Hq, h = t % Hq, g = h / (Hq / Hkv);
            const at::Tensor& k = keys[r];
            const at::Tensor& v = values[r];
            const int64_t L = k.size(2);
            scores.resize(static_cast<size_t>((L + 7) / 8 * 8));
            attend_one(Q + t * D, k.data_ptr<float>() + g * k.stride(1), k.stride(2),
                       v.data_ptr<float>() + g * v.stride(1), v.stride(2), L, D, s, scores.data(), O + t * D);
        }
    });
    return out;
}

}  // namespace

TORCH_LIBRARY(selfspec_compact, lib) {
    lib.def("q4_1_linear(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
    lib.def("q8_0_linear(Tensor x, Tensor codes, Tensor d) -> Tensor");
    lib.def("decode_attention(Tensor q, Tensor[] keys, Tensor[] values, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(selfspec_compact, CPU, lib) {
    lib.impl("q4_1_linear", &q4_1_linear);
    lib.impl("q8_0_linear", &q8_0_linear);
    lib.impl("decode_attention", &decode_attention);
}
