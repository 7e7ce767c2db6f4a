// y ~= x @ W^T for drafts: x rounded to int8 per 32-value block, W's Q4_0 / Q4_1 / Q8_0 codes multiplied by
// them as integers (llama.cpp's route), for the one or two rows a chain draft feeds.
//
// NOT the target's arithmetic: a draft through this kernel is another model's guess, close to the target's
// (each product's input rounded to 8 bits: ~0.5-1% relative error a layer), and the verifier keeps only what
// the target's own exact forward agrees with. So it is reached only inside ``qlinear.approximate()``, which
// the self-speculative drafters hold around their draft forwards (docs/decisions/015-quant-kernels.md).
// Why it pays where the exact kernel is arithmetic-bound (Zen 4 runs a 512-bit FMA as two halves): a block of
// 32 weights is one integer dot product (vpdpbusd; AVX2: vpmaddubsw + vpmaddwd) and one scale FMA a row,
// where the exact kernel converts, scales and multiplies every weight in fp32.
//
// Per row: xq = round(x / dx) with dx = max|x| / 127 per block of 32, sx = dx * sum(xq). Per block of a
// feature: Q4_1 (w = d q + m): d dx dot(q, xq) + m sx; Q4_0 (w = d (q - 8)): d dx dot(q, xq) - 8 d sx;
// Q8_0 (w = d q, q signed): d dx dot(|q|, sign(xq, q)). Threads: torch's pool over output features.
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

constexpr int64_t kGrain = 16;  // output features per parallel work item, at least
constexpr int kGroup = 4;       // features sharing each loaded block of xq
constexpr int kAhead = 2;       // prefetch distance in groups (as quant_linear.cpp's)
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML types

#if defined(__AVX2__)

using specdec_vec::f16;  // a block's f16 scale, by vec.h's table

// sum over groups of 4 of u8 x s8 products into the int32 lanes of acc
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else  // pairs into int16 (at most 2 x 128 x 127: no saturation), then pairs of those into int32
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// a Q4 block's 16 bytes of nibbles -> its 32 codes in weight order (low nibbles are weights 0-15)
inline __m256i nibbles(const uint8_t* q) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

struct Row {  // one row of x, rounded
  std::vector<int8_t> q;   // [K]
  std::vector<float> d;    // [K / 32] dx
  std::vector<float> s;    // [K / 32] dx * sum(q of the block)
};

void round_row(const float* x, int64_t K, Row& r) {
  r.q.resize(K);
  r.d.resize(K / 32);
  r.s.resize(K / 32);
  for (int64_t b = 0; b < K / 32; ++b) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int q = static_cast<int>(std::nearbyint(x[b * 32 + i] * inv));  // in [-127, 127]
      r.q[b * 32 + i] = static_cast<int8_t>(q);
      sum += q;
    }
    r.d[b] = d;
    r.s[b] = d * static_cast<float>(sum);
  }
}

// y[f] for G features (rows of blocks ``rb`` bytes apart from w) against one rounded row
template <int Type, int G>
inline void features(const uint8_t* w, int64_t rb, int64_t nb, const Row& x, float* y) {
  constexpr int kBytes = Type == kQ4_0 ? 18 : Type == kQ4_1 ? 20 : 34;
  __m256 acc[G];
  float off[G];
  for (int f = 0; f < G; ++f) {
    acc[f] = _mm256_setzero_ps();
    off[f] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + b * 32));
    const float dx = x.d[b], sx = x.s[b];
#pragma GCC unroll 4
    for (int f = 0; f < G; ++f) {
      const uint8_t* blk = w + f * rb + b * kBytes;
      const float d = f16(blk);
      __m256i dot;
      if constexpr (Type == kQ8_0) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        dot = dot_u8s8(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
      } else {
        dot = dot_u8s8(_mm256_setzero_si256(), nibbles(blk + (Type == kQ4_1 ? 4 : 2)), xv);
        off[f] += Type == kQ4_1 ? f16(blk + 2) * sx : -8.f * d * sx;
      }
      acc[f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * dx), acc[f]);
    }
  }
  for (int f = 0; f < G; ++f) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[f]), _mm256_extractf128_ps(acc[f], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    y[f] = _mm_cvtss_f32(s) + off[f];
  }
}

template <int Type>
void feature_range(const uint8_t* w, int64_t rb, int64_t nb, const std::vector<Row>& rows, float* y, int64_t N,
                   int64_t a, int64_t b) {
  float out[kGroup];
  int64_t n = a;
  for (; n + kGroup <= b; n += kGroup) {
    // the blocks come from memory: fetch the group kAhead groups on while this one is multiplied
    if (n + (kAhead + 1) * kGroup <= b)
      for (int64_t i = 0; i < kGroup * rb; i += 64) __builtin_prefetch(w + (n + kAhead * kGroup) * rb + i, 0, 2);
    for (size_t m = 0; m < rows.size(); ++m) {
      features<Type, kGroup>(w + n * rb, rb, nb, rows[m], out);
      for (int f = 0; f < kGroup; ++f) y[m * N + n + f] = out[f];
    }
  }
  for (; n < b; ++n)
    for (size_t m = 0; m < rows.size(); ++m) {
      features<Type, 1>(w + n * rb, rb, nb, rows[m], out);
      y[m * N + n] = out[0];
    }
}

#endif  // __AVX2__

// x [M, K] (float32) through the weights ``blocks`` (uint8 [N_p, row_bytes_p] of GGML types ``fmts``: Q4_0,
// Q4_1, Q8_0) -> [M, sum of N_p] float32, their outputs side by side; approximate (the file's comment)
at::Tensor quant_linear_i8(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef fmts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) >= 1 && x.size(1) % 32 == 0,
              "quant_linear_i8: x float32 [M >= 1, K], K a multiple of 32");
  TORCH_CHECK(blocks.size() == fmts.size() && !blocks.empty(), "quant_linear_i8: one format per part");
#if defined(__AVX2__)
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  std::vector<int64_t> start{0};
  for (size_t p = 0; p < blocks.size(); ++p) {
    const int64_t t = fmts[p];
    TORCH_CHECK(t == kQ4_0 || t == kQ4_1 || t == kQ8_0, "quant_linear_i8: GGML type ", t, " is not Q4_0, Q4_1 or Q8_0");
    const int64_t bytes = t == kQ4_0 ? 18 : t == kQ4_1 ? 20 : 34;
    TORCH_CHECK(blocks[p].scalar_type() == at::kByte && blocks[p].dim() == 2 && blocks[p].is_contiguous()
                && blocks[p].size(1) == nb * bytes, "quant_linear_i8: part ", p, " is not uint8 [N, ", nb * bytes, "]");
    start.push_back(start.back() + blocks[p].size(0));
  }
  const int64_t N = start.back();
  const at::Tensor xc = x.contiguous();
  std::vector<Row> rows(M);
  for (int64_t m = 0; m < M; ++m) round_row(xc.data_ptr<float>() + m * K, K, rows[m]);
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (size_t p = 0; p < blocks.size(); ++p) {
      const int64_t a = std::max(n0, start[p]) - start[p], b = std::min(n1, start[p + 1]) - start[p];
      if (a >= b) continue;
      const uint8_t* w = blocks[p].data_ptr<uint8_t>();
      const int64_t rb = blocks[p].size(1);
      float* yq = yp + start[p];
      switch (fmts[p]) {
        case kQ4_0: feature_range<kQ4_0>(w, rb, nb, rows, yq, N, a, b); break;
        case kQ4_1: feature_range<kQ4_1>(w, rb, nb, rows, yq, N, a, b); break;
        default: feature_range<kQ8_0>(w, rb, nb, rows, yq, N, a, b); break;
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
