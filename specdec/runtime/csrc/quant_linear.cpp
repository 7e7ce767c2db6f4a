// y = x @ W^T for a few rows of x (decode, verify, ragged batches), W held as GGUF blocks.
//
// A quantized target keeps each weight matrix as the file's blocks, uint8 [N, row_bytes] (row n: its K
// weights as K / QK blocks); specdec/quant/formats.py has the layouts and the reference dequantizers that
// define the weights. This kernel reads each block once per pass of rows, dequantizes it in registers
// with the reference's own fp32 operations (the same products and sums in the same order, so each weight
// is bit for bit the reference's), and accumulates w * x in fp32: the result is the reference's
// F.linear(x, dequantize(W)) up to summation order. The weights stream at 4.5-8.5 bits a weight instead
// of 32, so a step is bound by the decoding arithmetic and the blocks' arrival, not by bandwidth.
//
// Shape: one output feature at a time (four for one row, two for two: independent FMA chains), its row
// of blocks against M rows of x: M vector accumulators (one per row), a block's weights decoded one vector at a time and each vector fed to all M rows
// before the next (so a decoded weight lives in one register); a horizontal sum per (row, feature) at
// the end. AVX-512: vectors of 16, up to 16 rows a pass (16 accumulators + decode temporaries < 32
// registers); AVX2: vectors of 8, up to 8 rows a pass (16 registers). More rows: balanced passes over
// each output feature's row of blocks, which the passes after the first read from L1. Threads: torch's
// pool over output features (at::parallel_for, as packed_linear.cpp).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers only
#include <ATen/core/Tensor.h>  // the Tensor, its methods, and each op used from its own header
                                // (ATen.h declares every op: docs/decisions/015-quant-kernels.md)
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <utility>

#include "ops.h"
#include "vec.h"

namespace {

using specdec_vec::hsum;
using specdec_vec::kLanes;
using specdec_vec::splat;
using specdec_vec::vec;
typedef uint8_t bytes __attribute__((vector_size(kLanes)));  // kLanes bytes: one vector's worth of quants
typedef int8_t sbytes __attribute__((vector_size(kLanes)));

constexpr int kMaxRows = kLanes == 16 ? 16 : 8;  // rows per pass: accumulators that fit the registers
constexpr int64_t kGrain = 16;  // output features per parallel work item, at least
// prefetch the feature group this many groups ahead: in a step the blocks come from outside L2 (a
// distance tuned on one machine: docs/decisions/015-quant-kernels.md)
constexpr int kAhead = 2;

inline bytes load_bytes(const uint8_t* p) {
  bytes b;
  std::memcpy(&b, p, sizeof(b));
  return b;
}

// bytes -> floats by the widening instructions (GCC's __builtin_convertvector goes a byte at a time)
inline __m128i as_m128i(const void* b, int n) {
  __m128i r = _mm_setzero_si128();
  std::memcpy(&r, b, n);
  return r;
}

inline vec from_ints(__m128i b, bool is_signed) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
  const __m256 f = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#endif
  vec v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}

inline vec to_float(bytes b) { return from_ints(as_m128i(&b, sizeof(b)), false); }

inline vec to_float(sbytes b) { return from_ints(as_m128i(&b, sizeof(b)), true); }

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// a * q, rounded on its own before the caller adds to it (as torch computes d * q + m: two roundings;
// without the barrier the compiler fuses the two into one FMA, which rounds once)
inline vec product(vec a, vec q) {
  vec p = a * q;
  asm("" : "+v"(p));
  return p;
}

// Each format: kWeights and kBytes per block, and decode(block, emit) calling emit(offset, w) for each
// vector of kLanes dequantized weights at weight ``offset`` of the block (formats.py's definitions).
struct Q8_0 {
  static constexpr int kWeights = 32, kBytes = 34;
  template <class Emit>
  static void decode(const uint8_t* b, Emit&& emit) {
    const vec d = splat(f16(b));
    for (int c = 0; c < 32; c += kLanes) {
      sbytes q;
      std::memcpy(&q, b + 2 + c, sizeof(q));
      emit(c, d * to_float(q));  // d * q
    }
  }
};

// Q4_0 and Q4_1: byte j's low nibble is weight j, its high nibble weight j + 16; ``nibbles`` emits the 32
// weights of 16 such bytes, each ``value(q)`` of its nibble q (the format's definition, as floats).
#if defined(__AVX512F__)
// AVX-512: a 4-bit weight is looked up, not converted: the block's 16 possible values are computed once
// (``value`` on 0..15: the reference's own operations, so each is its weight bit for bit) into one
// register, and vpermps picks each lane's by the low 4 bits of its byte (widened to 32 bits): 3
// instructions per 16 weights instead of 6 (widen, convert, multiply, add, mask or shift, FMA).
inline vec iota() { return vec{0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f}; }

inline __m512i widen16(const uint8_t* p) {  // 16 bytes -> 16 lanes of 32 bits
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline vec lookup(__m512i idx, vec table) {  // table[idx & 15] per lane
  const __m512 w = _mm512_permutexvar_ps(idx, reinterpret_cast<__m512>(table));
  return reinterpret_cast<vec>(w);
}

template <class Value, class Emit>
inline void nibbles(const uint8_t* q, Value&& value, Emit&& emit) {
  const vec table = value(iota());
  const __m512i idx = widen16(q);
  emit(0, lookup(idx, table));
  emit(16, lookup(_mm512_srli_epi32(idx, 4), table));
}
#else
template <class Value, class Emit>
inline void nibbles(const uint8_t* q, Value&& value, Emit&& emit) {
  for (int c = 0; c < 16; c += kLanes) {
    const bytes b = load_bytes(q + c);
    emit(c, value(to_float(b & 15)));
    emit(16 + c, value(to_float(b >> 4)));
  }
}
#endif

struct Q4_0 {
  static constexpr int kWeights = 32, kBytes = 18;
  template <class Emit>
  static void decode(const uint8_t* b, Emit&& emit) {
    const vec d = splat(f16(b));
    nibbles(b + 2, [d](vec q) { return d * (q - 8.f); }, emit);  // d * (q - 8); q - 8 exact
  }
};

struct Q4_1 {
  static constexpr int kWeights = 32, kBytes = 20;
  template <class Emit>
  static void decode(const uint8_t* b, Emit&& emit) {
    const vec d = splat(f16(b)), m = splat(f16(b + 2));
    nibbles(b + 4, [d, m](vec q) { return product(d, q) + m; }, emit);  // d * q + m
  }
};

// The K formats' 6-bit scale and min of sub-block j (formats.py's packing of 12 bytes)
inline void k_scale(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K and Q5_K: 8 sub-blocks of 32, w = (d * sc) * q - (dmin * mn); byte l of 32-byte group g holds
// weight l of sub-block 2g (low nibble) and of 2g + 1 (high nibble); Q5_K's bit s of qh[l] is the fifth
// bit of weight l of sub-block s. d * sc and dmin * mn are exact in fp32 (11 by 6 bits).
template <bool Five>
struct QK4or5 {
  static constexpr int kWeights = 256, kBytes = Five ? 176 : 144;
  template <class Emit>
  static void decode(const uint8_t* b, Emit&& emit) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* qs = b + (Five ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      k_scale(b + 4, j, &sc, &mn);
      const vec a = splat(d * static_cast<float>(sc)), m = splat(dmin * static_cast<float>(mn));
#if defined(__AVX512F__)
      // the sub-block's 16 (Q4_K) or 32 (Q5_K: two registers, vpermt2ps) values looked up as Q4_1's
      const vec low = product(a, iota()) - m;
      const vec high = Five ? product(a, iota() + 16.f) - m : low;
      for (int c = 0; c < 32; c += 16) {
        __m512i idx = widen16(qs + (j / 2) * 32 + c);
        if (j & 1) idx = _mm512_srli_epi32(idx, 4);
        if (Five) {
          const __m512i top = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(widen16(b + 16 + c), j),
                                                                 _mm512_set1_epi32(1)), 4);
          idx = _mm512_or_si512(_mm512_and_si512(idx, _mm512_set1_epi32(15)), top);
          emit(j * 32 + c, reinterpret_cast<vec>(_mm512_permutex2var_ps(
                               reinterpret_cast<__m512>(low), idx, reinterpret_cast<__m512>(high))));
        } else {
          emit(j * 32 + c, lookup(idx, low));
        }
      }
#else
      const int shift = (j & 1) * 4;
      for (int c = 0; c < 32; c += kLanes) {
        bytes q = (load_bytes(qs + (j / 2) * 32 + c) >> shift) & 15;
        if (Five) q |= ((load_bytes(b + 16 + c) >> j) & 1) << 4;
        emit(j * 32 + c, product(a, to_float(q)) - m);
      }
#endif
    }
  }
};

// Q6_K: 16 sub-blocks of 16, w = (d * scale) * (q - 32) (d * scale exact: 11 by 8 bits); per half h and
// quarter r, weight 128h + 32r + l takes the low (r < 2) or high nibble of ql[64h + 32(r % 2) + l] and bits
// 2r, 2r + 1 of qh[32h + l] as its top two bits.
struct Q6_K {
  static constexpr int kWeights = 256, kBytes = 210;
  template <class Emit>
  static void decode(const uint8_t* b, Emit&& emit) {
    const float d = f16(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 4; ++r)
        for (int l = 0; l < 32; l += kLanes) {
          const int at = 128 * h + 32 * r + l;
          const bytes low = load_bytes(b + 64 * h + 32 * (r % 2) + l);
          const bytes q = ((r < 2 ? low : low >> 4) & 15) | (((load_bytes(b + 128 + 32 * h + l) >> (2 * r)) & 3) << 4);
          emit(at, splat(d * static_cast<float>(scales[at / 16])) * (to_float(q) - 32.f));
        }
  }
};

// M rows of x [M, K] (row stride K) against NF output features' rows of blocks (``row``, then every
// ``row_bytes``) -> y[m * N + f]. Each (row, feature) has its own accumulator, summed in block order
// whatever M and NF are, so a row's result is the same bit for bit in any pass (decode, verify, batch).
// NF > 1 for few rows: independent accumulators for the FMA pipes, which one row alone cannot fill.
template <class F, int M, int NF>
void rows_dot(const float* x, const uint8_t* row, int64_t row_bytes, float* y, int64_t K, int64_t N) {
  vec acc[NF][M];
#pragma GCC unroll 16
  for (int f = 0; f < NF; ++f)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[f][m] = vec{};
  for (int64_t k0 = 0; k0 < K; k0 += F::kWeights) {
    const uint8_t* block = row + k0 / F::kWeights * F::kBytes;
#pragma GCC unroll 8
    for (int f = 0; f < NF; ++f) {
      // every cache line of the block kAhead groups ahead (a K block spans 3-4 lines; Q4_0's and Q8_0's one)
      const char* ahead = reinterpret_cast<const char*>(block + (f + kAhead * NF) * row_bytes);
#pragma GCC unroll 4
      for (int line = 0; line < F::kBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      F::decode(block + f * row_bytes, [&](int off, vec w) {
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) acc[f][m] += w * specdec_vec::load(x + m * K + k0 + off);
      });
    }
  }
#pragma GCC unroll 8
  for (int f = 0; f < NF; ++f)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) y[m * N + f] = hsum(acc[f][m]);
}

// output features per call for M rows: accumulators for 4+ independent chains where registers allow
constexpr int features_for(int m) { return m == 1 ? 4 : m == 2 ? 2 : 1; }

using RowsFn = void (*)(const float*, const uint8_t*, int64_t, float*, int64_t, int64_t);
template <class F, int... Ms>
RowsFn pick(int m, bool several, std::integer_sequence<int, Ms...>) {
  static constexpr RowsFn one[] = {rows_dot<F, Ms + 1, 1>...};
  static constexpr RowsFn wide[] = {rows_dot<F, Ms + 1, features_for(Ms + 1)>...};
  return (several ? wide : one)[m - 1];
}

template <class F>
at::Tensor run(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % F::kWeights == 0 && blocks.size(1) == K / F::kWeights * F::kBytes, "quant_linear: blocks [",
              N, ", ", blocks.size(1), "] are not rows of ", K, " weights in this format (", F::kBytes,
              " bytes per ", F::kWeights, ")");
  const at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = bc.size(1);
  const int passes = static_cast<int>((M + kMaxRows - 1) / kMaxRows);
  const auto rows = std::make_integer_sequence<int, kMaxRows>{};
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    if (passes == 1) {  // NF features at a time, the rest one by one
      const int nf = features_for(static_cast<int>(M));
      int64_t n = n0;
      for (const RowsFn fn = pick<F>(static_cast<int>(M), true, rows); n + nf <= n1; n += nf)
        fn(xp, wp + n * row_bytes, row_bytes, yp + n, K, N);
      for (const RowsFn fn = pick<F>(static_cast<int>(M), false, rows); n < n1; ++n)
        fn(xp, wp + n * row_bytes, row_bytes, yp + n, K, N);
      return;
    }
    for (int64_t n = n0; n < n1; ++n) {
      int64_t m0 = 0;
      for (int c = 0; c < passes; ++c) {  // balanced passes: 20 rows -> 10 + 10
        const int mc = static_cast<int>((M - m0) / (passes - c));
        pick<F>(mc, false, rows)(xp + m0 * K, wp + n * row_bytes, row_bytes, yp + m0 * N + n, K, N);
        m0 += mc;
      }
    }
  });
  return y;
}

// fmt: the GGML type number (formats.py's BlockFormat.ggml_type)
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) >= 1, "quant_linear: x float32 [M >= 1, K]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte, "quant_linear: blocks uint8 [N, row_bytes]");
  switch (fmt) {
    case 8: return run<Q8_0>(x, blocks);
    case 2: return run<Q4_0>(x, blocks);
    case 3: return run<Q4_1>(x, blocks);
    case 12: return run<QK4or5<false>>(x, blocks);
    case 13: return run<QK4or5<true>>(x, blocks);
    case 14: return run<Q6_K>(x, blocks);
    default: TORCH_CHECK(false, "quant_linear: GGML type ", fmt, " has no kernel (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K do)");
  }
}

}  // namespace

SPECDEC_FRAGMENT(SPECDEC_OPS, m) {
  m.def("quant_linear(Tensor x, Tensor blocks, int fmt) -> Tensor");
}
SPECDEC_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) { m.impl("quant_linear", &quant_linear); }
