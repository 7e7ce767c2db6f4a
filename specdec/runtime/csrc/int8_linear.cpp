// y = x @ W^T in int8 numerics: x rounded per row to 8-bit blocks of 32, W's Q8_0 / Q4_0 / Q4_1 codes
// multiplied by them as integers (llama.cpp's arithmetic), fp32 scales. The one int8 kernel: a target
// loaded with numerics="int8" runs every row through it (decode, verify, batches, prefill), and the
// self-speculative drafters' approximate forwards over an exact target take it too (qlinear.approximate).
//
// Batch invariance, by construction (docs/decisions/019-int8-numerics.md): the value of y[r, n] is the
// same whatever the number of rows M, the row's place among them, the thread count and the build:
//   - each row is rounded alone (round_rows: per block of 32, dx = max|x| / 127, xq = nearbyint(x / dx));
//   - per (row, feature) one accumulator receives, block by block in file order, the block's exact int32
//     dot product (lane j holds the products of weights 4j..4j+3; vpdpbusd and AVX2's vpmaddubsw +
//     vpmaddwd give the same integers) converted to float and multiplied by d * dx with one explicit FMA,
//     and an offset term (Q4_1's m * sx, Q4_0's -8 d * sx) with one explicit std::fma; then one fixed
//     horizontal sum. Tiles of rows and of features only decide which accumulators share a loaded block;
//     threads split the output features, never the sum over K.
// Per block of a feature, with sx = dx * sum(xq): Q4_1 (w = d q + m): d dx dot(q, xq) + m sx; Q4_0
// (w = d (q - 8)): d dx dot(q, xq) - 8 d sx; Q8_0 (w = d q, q signed): d dx dot(|q|, sign(xq, q)).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

#if defined(__AVX2__)
using specdec_vec::hsum8;
#endif

constexpr int64_t kGrain = 16;     // output features per parallel work item, at least
constexpr int64_t kRowBlock = 64;  // rows whose rounded activations stay in L2 while a thread's features pass
constexpr int kRows = 4;           // rows sharing each decoded weight block (a tile)
#if defined(__AVX512VL__)
constexpr int kFeatures = 4;       // features a tile: 16 accumulators, 32 vector registers
#else
constexpr int kFeatures = 2;       // AVX2: 8 accumulators of 16 registers
#endif
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML types

constexpr int64_t block_bytes(int type) { return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : 34; }

#if defined(__AVX2__)

using specdec_vec::f16;

// sum over groups of 4 of u8 x s8 products into the int32 lanes of acc (no saturation: |products| of a
// pair < 2^15 for these codes)
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// a Q4 block's 16 bytes of nibbles -> its 32 codes in weight order (low nibbles are weights 0-15)
inline __m256i nibbles(const uint8_t* q) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

struct Rounded {  // every row of x rounded: codes [M, K], dx [M, K / 32], sx = dx * sum(codes) [M, K / 32]
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

void round_rows(const float* x, int64_t M, int64_t K, Rounded& r) {
  const int64_t nb = K / 32;
  r.q.resize(M * K);
  r.d.resize(M * nb);
  r.s.resize(M * nb);
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + m * K + b * 32;
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < 32; ++i) {
          const float scaled = xb[i] * inv;
          const int q = static_cast<int>(std::nearbyint(scaled));  // in [-127, 127]
          r.q[m * K + b * 32 + i] = static_cast<int8_t>(q);
          sum += q;
        }
        r.d[m * nb + b] = d;
        r.s[m * nb + b] = d * static_cast<float>(sum);
      }
  });
}

// y[r, f] for R rows x G features: rows ``r0..r0+R`` of ``x``, features at w, w + rb, ... (rb bytes apart)
template <int Type, int R, int G>
inline void tile(const uint8_t* w, int64_t rb, int64_t nb, const Rounded& x, int64_t K, int64_t r0, float* y,
                 int64_t N) {
  constexpr int64_t kBytes = block_bytes(Type);
  __m256 acc[R][G];
  float off[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps(), off[r][g] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i c[G];
    float d[G], m[G];
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = w + g * rb + b * kBytes;
      d[g] = f16(blk);
      m[g] = Type == kQ4_1 ? f16(blk + 2) : 0.f;
      if constexpr (Type == kQ8_0)
        c[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      else
        c[g] = nibbles(blk + (Type == kQ4_1 ? 4 : 2));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + row * K + b * 32));
      const float dx = x.d[row * nb + b], sx = x.s[row * nb + b];
      for (int g = 0; g < G; ++g) {
        __m256i dot;
        if constexpr (Type == kQ8_0)
          dot = dot_u8s8(_mm256_setzero_si256(), _mm256_sign_epi8(c[g], c[g]), _mm256_sign_epi8(xv, c[g]));
        else
          dot = dot_u8s8(_mm256_setzero_si256(), c[g], xv);
        const float scale = d[g] * dx;
        acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), acc[r][g]);
        if constexpr (Type == kQ4_1) off[r][g] = std::fma(m[g], sx, off[r][g]);
        if constexpr (Type == kQ4_0) off[r][g] = std::fma(-8.f * d[g], sx, off[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const float s = hsum8(acc[r][g]);
      y[(r0 + r) * N + g] = s + off[r][g];
    }
}

template <int Type, int G>
inline void rows_tile(const uint8_t* w, int64_t rb, int64_t nb, const Rounded& x, int64_t K, int64_t a, int64_t b,
                      float* y, int64_t N) {
  int64_t r = a;
  for (; r + kRows <= b; r += kRows) tile<Type, kRows, G>(w, rb, nb, x, K, r, y, N);
  switch (b - r) {
    case 3: tile<Type, 3, G>(w, rb, nb, x, K, r, y, N); break;
    case 2: tile<Type, 2, G>(w, rb, nb, x, K, r, y, N); break;
    case 1: tile<Type, 1, G>(w, rb, nb, x, K, r, y, N); break;
    default: break;
  }
}

// features [a, b) of one weight (y: its first output column, row stride N) for every row
template <int Type>
void feature_range(const uint8_t* w, int64_t rb, int64_t nb, const Rounded& x, int64_t M, int64_t K, float* y,
                   int64_t N, int64_t a, int64_t b) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    int64_t n = a;
    for (; n + kFeatures <= b; n += kFeatures) {
      if (n + 2 * kFeatures <= b)  // the next group's blocks, while this one is multiplied
        for (int64_t i = 0; i < kFeatures * rb; i += 64) __builtin_prefetch(w + (n + kFeatures) * rb + i, 0, 2);
      rows_tile<Type, kFeatures>(w + n * rb, rb, nb, x, K, m0, m1, y + n, N);
    }
    for (; n < b; ++n) rows_tile<Type, 1>(w + n * rb, rb, nb, x, K, m0, m1, y + n, N);
  }
}

#endif  // __AVX2__

// x [M, K] (float32) through the weights ``blocks`` (uint8 [N_p, row_bytes_p] of GGML types ``fmts``: Q4_0,
// Q4_1, Q8_0) -> [M, sum of N_p] float32, their outputs side by side, in int8 numerics (the file's comment)
at::Tensor quant_linear_i8(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef fmts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "quant_linear_i8: x float32 [M, K], K a multiple of 32");
  TORCH_CHECK(blocks.size() == fmts.size() && !blocks.empty(), "quant_linear_i8: one format per part");
#if defined(__AVX2__)
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  std::vector<int64_t> start{0};
  for (size_t p = 0; p < blocks.size(); ++p) {
    const int64_t t = fmts[p];
    TORCH_CHECK(t == kQ4_0 || t == kQ4_1 || t == kQ8_0, "quant_linear_i8: GGML type ", t, " is not Q4_0, Q4_1 or Q8_0");
    TORCH_CHECK(blocks[p].scalar_type() == at::kByte && blocks[p].dim() == 2 && blocks[p].is_contiguous()
                && blocks[p].size(1) == nb * block_bytes(t), "quant_linear_i8: part ", p, " is not uint8 [N, ",
                nb * block_bytes(t), "]");
    start.push_back(start.back() + blocks[p].size(0));
  }
  const int64_t N = start.back();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const at::Tensor xc = x.contiguous();
  Rounded rx;
  round_rows(xc.data_ptr<float>(), M, K, rx);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (size_t p = 0; p < blocks.size(); ++p) {
      const int64_t a = std::max(n0, start[p]) - start[p], b = std::min(n1, start[p + 1]) - start[p];
      if (a >= b) continue;
      const uint8_t* w = blocks[p].data_ptr<uint8_t>();
      const int64_t rb = blocks[p].size(1);
      float* yq = yp + start[p];
      switch (fmts[p]) {
        case kQ4_0: feature_range<kQ4_0>(w + 0, rb, nb, rx, M, K, yq, N, a, b); break;
        case kQ4_1: feature_range<kQ4_1>(w + 0, rb, nb, rx, M, K, yq, N, a, b); break;
        default: feature_range<kQ8_0>(w + 0, rb, nb, rx, M, K, yq, N, a, b); break;
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "quant_linear_i8: this build has no AVX2");
  return x;
#endif
}

}  // namespace

SPECDEC_FRAGMENT(SPECDEC_OPS, m) {
  m.def("quant_linear_i8(Tensor x, Tensor[] blocks, int[] fmts) -> Tensor");
}
SPECDEC_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) { m.impl("quant_linear_i8", &quant_linear_i8); }
