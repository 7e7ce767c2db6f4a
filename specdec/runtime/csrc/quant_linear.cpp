// y = x @ W^T for a few rows of x (decode, verify, ragged batches), W held as GGUF blocks.
//
// A quantized target keeps each weight matrix as the file's blocks, uint8 [N, row_bytes] (row n: its K
// weights as K / QK blocks); specdec/formats.py has the layouts and the reference dequantizers that
// define the weights. This kernel reads each block once per pass of rows, dequantizes it in registers
// with the reference's own fp32 operations (the same products and sums in the same order, so each weight
// is bit for bit the reference's), and accumulates w * x in fp32: the result is the reference's
// F.linear(x, dequantize(W)) up to summation order. The weights stream at 4.5-8.5 bits a weight instead
// of 32, so a step is bound by the decoding arithmetic and the blocks' arrival, not by bandwidth.
//
// Shape: a few output features at a time (``Shape``: NF of them), their rows of blocks against a pass of
// rows of x: one vector accumulator per (row, feature), each decoded vector fed to every row of the pass
// (AVX-512 with 32-weight blocks: the NF features' blocks decoded whole first, so each vector of x is
// loaded once for all NF); a horizontal sum per (row, feature) at the end. More rows than a pass holds:
// balanced passes over the same features, which the passes after the first read from L1. Threads:
// torch's pool over output features (at::parallel_for, as packed_linear.cpp).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers only
#include <ATen/core/Tensor.h>  // the Tensor, its methods, and each op used from its own header
                                // (ATen.h declares every op: docs/decisions/015-quant-kernels.md)
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using specdec_vec::f16;  // a block's f16 scale, by vec.h's table
using specdec_vec::hsum;
using specdec_vec::kLanes;
using specdec_vec::vec;
typedef uint8_t bytes __attribute__((vector_size(kLanes)));  // kLanes bytes: one vector's worth of quants
typedef int8_t sbytes __attribute__((vector_size(kLanes)));

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

// x in every lane by a broadcast (from memory where x was just loaded: a table's scale), not vec.h's
// ``vec{} + x``, which GCC computes as a scalar add and a broadcast from a register (the shuffle port)
inline vec splat(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vec>(_mm512_set1_ps(x));
#else
  return reinterpret_cast<vec>(_mm256_set1_ps(x));
#endif
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
// AVX2: the 16 bytes split into low and high nibbles in one SSE register (shifted as 16-bit lanes, the bits
// crossing from a neighbour masked off: GCC 12 shifts an 8-byte vector a byte at a time in general registers,
// ~35 instructions; 015, Decision: the exact block kernel), each half widened 8 at a time, emitted in the
// order 0, 16, 8, 24
template <class Value, class Emit>
inline void nibbles(const uint8_t* q, Value&& value, Emit&& emit) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), mask = _mm_set1_epi8(15);
  const __m128i low = _mm_and_si128(raw, mask), high = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  emit(0, value(from_ints(low, false)));
  emit(16, value(from_ints(high, false)));
  emit(8, value(from_ints(_mm_srli_si128(low, 8), false)));
  emit(24, value(from_ints(_mm_srli_si128(high, 8), false)));
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
  static constexpr int kScales = 8;  // sub-blocks: a scale and a min each
  // d * scale and dmin * min of the 8 sub-blocks (as floats in memory: ``sub`` broadcasts them from there)
  static void scales(const uint8_t* b, float* scale, float* min) {
    const float d = f16(b), dmin = f16(b + 2);
#if defined(__AVX2__)
    // k_scale for all 8 at once, four 6-bit values a 32-bit word: words w0 w1 w2 are bytes 0-3, 4-7, 8-11
    uint32_t w[3];
    std::memcpy(w, b + 4, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    const uint64_t sc = (w[0] & low6) | static_cast<uint64_t>((w[2] & low4) | (((w[0] >> 6) & top2) << 4)) << 32;
    const uint64_t mn = (w[1] & low6) | static_cast<uint64_t>(((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4)) << 32;
    const auto floats = [](uint64_t q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(q))); };
    _mm256_store_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d), floats(sc)));  // d * scale, as the scalar product
    _mm256_store_ps(min, _mm256_mul_ps(_mm256_set1_ps(dmin), floats(mn)));
#else
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      k_scale(b + 4, j, &sc, &mn);
      scale[j] = d * static_cast<float>(sc);
      min[j] = dmin * static_cast<float>(mn);
    }
#endif
  }
#if defined(__AVX512F__)
  static constexpr bool kSubBlocks = true;  // rows_dot decodes sub-block by sub-block (``sub``)
  // sub-block j's 32 weights as 2 vectors: its 16 (Q4_K) or 32 (Q5_K: two registers, vpermt2ps) values
  // looked up as Q4_1's
  static void sub(const uint8_t* b, int j, const float* scale, const float* min, vec* w) {
    const uint8_t* qs = b + (Five ? 48 : 16);
    const vec a = splat(scale[j]), m = splat(min[j]);
    const vec low = product(a, iota()) - m;
    const vec high = Five ? product(a, iota() + 16.f) - m : low;
    for (int c = 0; c < 32; c += 16) {
      __m512i idx = widen16(qs + (j / 2) * 32 + c);
      if (j & 1) idx = _mm512_srli_epi32(idx, 4);
      if (Five) {
        const __m512i top = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(widen16(b + 16 + c), j),
                                                               _mm512_set1_epi32(1)), 4);
        idx = _mm512_or_si512(_mm512_and_si512(idx, _mm512_set1_epi32(15)), top);
        w[c / 16] = reinterpret_cast<vec>(_mm512_permutex2var_ps(reinterpret_cast<__m512>(low), idx,
                                                                  reinterpret_cast<__m512>(high)));
      } else {
        w[c / 16] = lookup(idx, low);
      }
    }
  }
#else
  static constexpr bool kSubBlocks = false;
#endif
  template <class Emit>
  static void decode(const uint8_t* b, Emit&& emit) {
    alignas(32) float scale[8], min[8];
    scales(b, scale, min);
    for (int j = 0; j < 8; ++j) {
#if defined(__AVX512F__)
      vec w[2];
      sub(b, j, scale, min, w);
      emit(j * 32, w[0]);
      emit(j * 32 + 16, w[1]);
#else
      const vec a = splat(scale[j]), m = splat(min[j]);
      const uint8_t* qs = b + (Five ? 48 : 16);
      const __m128i shift = _mm_cvtsi32_si128((j & 1) * 4), fifth = _mm_cvtsi32_si128(j);
      for (int c = 0; c < 32; c += 16) {  // 16 codes a register, widened 8 at a time
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (j / 2) * 32 + c));
        __m128i q = _mm_and_si128(_mm_srl_epi16(raw, shift), _mm_set1_epi8(15));
        if (Five) {  // bit j of qh[l] as bit 4 (bit 0 of a byte moved within its 16-bit lane stays in its byte)
          const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + c));
          q = _mm_or_si128(q, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(qh, fifth), _mm_set1_epi8(1)), 4));
        }
        emit(j * 32 + c, product(a, from_ints(q, false)) - m);
        emit(j * 32 + c + 8, product(a, from_ints(_mm_srli_si128(q, 8), false)) - m);
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
#if defined(__AVX512F__)
  static constexpr bool kSubBlocks = true;  // rows_dot decodes 32 weights at a time (``sub``), as Q4_K's
  static constexpr int kScales = 16;
  static constexpr int kFewFeatures = 4;  // features a call at 1-2 rows (docs/decisions/015-quant-kernels.md)
  // d * scale of the 16 sub-blocks of 16 (as the scalar product: the int8 widened, converted, multiplied)
  static void scales(const uint8_t* b, float* scale, float* /*min: none*/) {
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    _mm512_store_ps(scale, _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), sc));
  }
  // weights 32j .. 32j + 31 (half h = j / 4, quarter r = j % 4) as 2 vectors, each (d * scale) * (q - 32)
  static void sub(const uint8_t* b, int j, const float* scale, const float*, vec* w) {
    const int h = j / 4, r = j % 4;
    for (int l = 0; l < 32; l += 16) {
      const bytes low = load_bytes(b + 64 * h + 32 * (r % 2) + l);
      const bytes q = ((r < 2 ? low : low >> 4) & 15) | (((load_bytes(b + 128 + 32 * h + l) >> (2 * r)) & 3) << 4);
      w[l / 16] = splat(scale[2 * j + l / 16]) * (to_float(q) - 32.f);
    }
  }
#endif
  template <class Emit>
  static void decode(const uint8_t* b, Emit&& emit) {
    const float d = f16(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 4; ++r)
        for (int l = 0; l < 32; l += 16) {  // 16 codes a register (one scale), widened kLanes at a time
          const int at = 128 * h + 32 * r + l;
          const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 * h + 32 * (r % 2) + l));
          const __m128i top = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 128 + 32 * h + l));
          const __m128i three = _mm_set1_epi8(3), fifteen = _mm_set1_epi8(15), shift = _mm_cvtsi32_si128(2 * r);
          // as 16-bit lanes: a byte's bits moved within it, what crosses from its neighbour masked off
          const __m128i q = _mm_or_si128(_mm_and_si128(r < 2 ? low : _mm_srli_epi16(low, 4), fifteen),
                                         _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(top, shift), three), 4));
          const vec scale = splat(d * static_cast<float>(scales[at / 16]));
          for (int c = 0; c < 16; c += kLanes)
            emit(at + c, scale * (from_ints(c ? _mm_srli_si128(q, 8) : q, false) - 32.f));
        }
  }
};

// Rows per pass and output features per call (NF) of a format: NF x rows accumulators beside the
// decoding's registers (docs/decisions/015-quant-kernels.md). AVX-512, 32-weight blocks (two vectors): a
// block of each of the NF features is decoded whole, then each vector of x is loaded once for the NF
// features; passes of at most 5 rows, 8 features for 1-2 rows, 4 for 3-5. The K formats on AVX-512 the
// same 32 weights at a time (a sub-block of Q4_K / Q5_K, two of Q6_K) for up to 5 rows, then passes of 16
// at one feature. Every format on AVX2 (16 registers): each vector fed to the rows as it is decoded,
// passes of 8 rows, 4 features for one row, 2 for two, else 1.
template <class F, class = void>
struct SubBlocks : std::false_type {};
template <class F>
struct SubBlocks<F, std::void_t<decltype(F::kSubBlocks)>> : std::bool_constant<F::kSubBlocks> {};

// output features a call for 1-2 rows where 32 weights are decoded at a time: 8, or F::kFewFeatures
template <class F, class = void>
struct FewFeatures : std::integral_constant<int, 8> {};
template <class F>
struct FewFeatures<F, std::void_t<decltype(F::kFewFeatures)>> : std::integral_constant<int, F::kFewFeatures> {};

template <class F>
struct Shape {
  static constexpr bool kSub = SubBlocks<F>::value;  // 256-weight blocks decoded 32 weights at a time
#if defined(__AVX512F__)
  static constexpr bool kWhole = F::kWeights == 32 || kSub;
#else
  static constexpr bool kWhole = false;
#endif
  static constexpr int kRows = kWhole && !kSub ? 5 : (kLanes == 16 ? 16 : 8);
  static constexpr int features(int m) {
    return kWhole ? (m <= 2 ? FewFeatures<F>::value : m <= 5 || !kSub ? 4 : 1) : (m == 1 ? 4 : m == 2 ? 2 : 1);
  }
};

// every cache line of the block ``block`` of each of the NF features kAhead groups ahead (a K block spans
// 3-4 lines; Q4_0's and Q8_0's one)
template <class F, int NF>
inline void prefetch_ahead(const uint8_t* block, int64_t row_bytes) {
#pragma GCC unroll 8
  for (int f = 0; f < NF; ++f) {
    const char* ahead = reinterpret_cast<const char*>(block + (f + kAhead * NF) * row_bytes);
#pragma GCC unroll 4
    for (int line = 0; line < F::kBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
}

// acc[f][m] += sum over the K weights of NF features' rows of blocks times x's M rows, for the K formats
// on AVX-512: per block the NF features' sub-block scales, then each 32 weights (2 vectors) of the NF
// features decoded whole and fed to the rows, each vector of x loaded once for the NF features; the
// same summation order as decoding the block at once.
template <class F, int M, int NF>
void rows_dot_sub(const float* x, const uint8_t* row, int64_t row_bytes, vec (&acc)[NF][M], int64_t K) {
  // the NF features' scales of the next block are unpacked while this block is decoded (two buffers):
  // broadcasting a scale straight after the vector store that wrote it waits for that store
  alignas(64) float scale[2][NF][F::kScales], min[2][NF][F::kScales];
#pragma GCC unroll 8
  for (int f = 0; f < NF; ++f) F::scales(row + f * row_bytes, scale[0][f], min[0][f]);
  for (int64_t k0 = 0, i = 0; k0 < K; k0 += F::kWeights, i ^= 1) {
    const uint8_t* block = row + k0 / F::kWeights * F::kBytes;
    prefetch_ahead<F, NF>(block, row_bytes);
    if (k0 + F::kWeights < K) {
#pragma GCC unroll 8
      for (int f = 0; f < NF; ++f) F::scales(block + F::kBytes + f * row_bytes, scale[i ^ 1][f], min[i ^ 1][f]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      vec w[NF][2];
#pragma GCC unroll 8
      for (int f = 0; f < NF; ++f) F::sub(block + f * row_bytes, j, scale[i][f], min[i][f], w[f]);
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v)
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          const vec a = specdec_vec::load(x + m * K + k0 + j * 32 + v * kLanes);
#pragma GCC unroll 8
          for (int f = 0; f < NF; ++f) acc[f][m] += w[f][v] * a;
        }
    }
  }
}

// M rows of x [M, K] (row stride K) against NF output features' rows of blocks (``row``, then every
// ``row_bytes``) -> y[m * N + f]. Each (row, feature) has its own accumulator, summed in block order
// and within a block in the order its vectors are decoded, whatever M and NF are, so a row's result is
// the same bit for bit in any pass (decode, verify, batch). NF > 1: independent accumulators for the
// FMA pipes (one row alone cannot fill them) and, for whole blocks, one load of x for NF features.
template <class F, int M, int NF>
void rows_dot(const float* x, const uint8_t* row, int64_t row_bytes, float* y, int64_t K, int64_t N) {
  vec acc[NF][M];
#pragma GCC unroll 16
  for (int f = 0; f < NF; ++f)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[f][m] = vec{};
  if constexpr (Shape<F>::kSub) {
    rows_dot_sub<F, M, NF>(x, row, row_bytes, acc, K);
  } else {
    constexpr int kVectors = F::kWeights / kLanes;
    for (int64_t k0 = 0; k0 < K; k0 += F::kWeights) {
      const uint8_t* block = row + k0 / F::kWeights * F::kBytes;
      prefetch_ahead<F, NF>(block, row_bytes);
      [[maybe_unused]] vec w[NF][Shape<F>::kWhole ? kVectors : 1];
#pragma GCC unroll 8
      for (int f = 0; f < NF; ++f)
        F::decode(block + f * row_bytes, [&](int off, vec v) {
          if constexpr (Shape<F>::kWhole) {
            w[f][off / kLanes] = v;  // kept for the rows below (offsets come in ascending order)
          } else {
#pragma GCC unroll 16
            for (int m = 0; m < M; ++m) acc[f][m] += v * specdec_vec::load(x + m * K + k0 + off);
          }
        });
      if constexpr (Shape<F>::kWhole) {
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v)
#pragma GCC unroll 16
          for (int m = 0; m < M; ++m) {
            const vec a = specdec_vec::load(x + m * K + k0 + v * kLanes);
#pragma GCC unroll 8
            for (int f = 0; f < NF; ++f) acc[f][m] += w[f][v] * a;
          }
      }
    }
  }
#pragma GCC unroll 8
  for (int f = 0; f < NF; ++f)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) y[m * N + f] = hsum(acc[f][m]);
}

using RowsFn = void (*)(const float*, const uint8_t*, int64_t, float*, int64_t, int64_t);
template <class F, int... Ms>
RowsFn pick(int m, bool several, std::integer_sequence<int, Ms...>) {
  static constexpr RowsFn one[] = {rows_dot<F, Ms + 1, 1>...};
  static constexpr RowsFn wide[] = {rows_dot<F, Ms + 1, Shape<F>::features(Ms + 1)>...};
  return (several ? wide : one)[m - 1];
}

// Output features [n0, n1) of one weight (``w``: its blocks, ``row_bytes`` a feature) against x [M, K]
// -> y[m * ldy + n] (y at the weight's first output column; ldy: the output's row stride)
template <class F>
void feature_range(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y,
                   int64_t ldy, int64_t n0, int64_t n1) {
  // balanced passes of at most kRows rows (12 -> 4 + 4 + 4), each a row block of its own
  constexpr int kRows = Shape<F>::kRows;
  const int passes = static_cast<int>((M + kRows - 1) / kRows);
  const int nf = Shape<F>::features(static_cast<int>(M / passes));  // every pass's (one_nf_per_call)
  const auto rows = std::make_integer_sequence<int, kRows>{};
  // nf features at a time, every pass over them while their blocks are in L1; the rest one by one
  for (int64_t n = n0; n < n1; n += nf) {
    const bool several = n + nf <= n1;
    for (int64_t f = n; f < (several ? n + 1 : n1); ++f)
      for (int64_t c = 0, m0 = 0; c < passes; ++c) {
        const int mc = static_cast<int>((M - m0) / (passes - c));
        pick<F>(mc, several, rows)(x + m0 * K, w + f * row_bytes, row_bytes, y + m0 * ldy + f, K, ldy);
        m0 += mc;
      }
  }
}

// One weight of ``fmt`` (the GGML type number: formats.py's BlockFormat.ggml_type), x [M, K]
struct Part {
  const uint8_t* w;
  int64_t row_bytes, N, fmt;
};

// Balanced passes (more rows than kRows) each hold at least (kRows + 1) / 2 rows: from there on one nf
template <class F>
constexpr bool one_nf_per_call() {
  for (int m = (Shape<F>::kRows + 1) / 2; m <= Shape<F>::kRows; ++m)
    if (Shape<F>::features(m) != Shape<F>::features(Shape<F>::kRows)) return false;
  return true;
}

template <class F>
void check(const Part& p, int64_t K) {
  static_assert(one_nf_per_call<F>(), "the passes of one call must share their features per call");
  TORCH_CHECK(K % F::kWeights == 0 && p.row_bytes == K / F::kWeights * F::kBytes, "quant_linear: blocks [",
              p.N, ", ", p.row_bytes, "] are not rows of ", K, " weights in this format (", F::kBytes,
              " bytes per ", F::kWeights, ")");
}

template <class F>
struct Format {
  using type = F;
};

// fn(Format<F>{}) for the format F named by ``fmt``
template <class Fn>
void by_format(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case 8: return fn(Format<Q8_0>{});
    case 2: return fn(Format<Q4_0>{});
    case 3: return fn(Format<Q4_1>{});
    case 12: return fn(Format<QK4or5<false>>{});
    case 13: return fn(Format<QK4or5<true>>{});
    case 14: return fn(Format<Q6_K>{});
    default: TORCH_CHECK(false, "quant_linear: GGML type ", fmt, " has no kernel (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K do)");
  }
}

// Several weights of K inputs each, side by side: their blocks (uint8 [N_p, row_bytes_p], GGML types
// ``fmts``, each checked against K), contiguous for the call, and where each one's output features start
struct Weights {
  std::vector<at::Tensor> kept;  // contiguous blocks, alive for the call
  std::vector<Part> parts;
  std::vector<int64_t> start{0};  // part p: output features start[p] .. start[p + 1] - 1

  Weights(at::TensorList blocks, at::IntArrayRef fmts, int64_t K, const char* op) {
    TORCH_CHECK(!blocks.empty() && blocks.size() == fmts.size(), op, ": ", blocks.size(), " weights and ",
                fmts.size(), " formats");
    for (size_t p = 0; p < blocks.size(); ++p) {
      TORCH_CHECK(blocks[p].dim() == 2 && blocks[p].scalar_type() == at::kByte, op, ": blocks uint8 [N, row_bytes]");
      kept.push_back(blocks[p].contiguous());
      parts.push_back({kept.back().data_ptr<uint8_t>(), kept.back().size(1), kept.back().size(0), fmts[p]});
      by_format(fmts[p], [&](auto f) { check<typename decltype(f)::type>(parts.back(), K); });
      start.push_back(start.back() + parts.back().N);
    }
  }

  int64_t features() const { return start.back(); }

  // fn(F, part p, its first and last-plus-one local output features within [n0, n1)), for each part there
  template <class Fn>
  void each(int64_t n0, int64_t n1, Fn&& fn) const {
    for (size_t p = 0; p < parts.size(); ++p) {
      const int64_t a = std::max(n0, start[p]), b = std::min(n1, start[p + 1]);
      if (a < b) by_format(parts[p].fmt, [&](auto f) { fn(f, p, a - start[p], b - start[p]); });
    }
  }
};

// x [M, K] through the weights ``blocks`` (uint8 [N_p, row_bytes_p], GGML types ``fmts``) -> [M, sum of N_p],
// their outputs side by side: one parallel region over every part's output features
at::Tensor quant_linear_parts(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef fmts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) >= 1, "quant_linear: x float32 [M >= 1, K]");
  const int64_t M = x.size(0), K = x.size(1);
  const Weights ws(blocks, fmts, K, "quant_linear");
  const at::Tensor xc = x.contiguous();
  const int64_t N = ws.features();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    ws.each(n0, n1, [&](auto f, size_t p, int64_t a, int64_t b) {
      const Part& q = ws.parts[p];
      feature_range<typename decltype(f)::type>(xp, M, K, q.w, q.row_bytes, yp + ws.start[p], N, a, b);
    });
  });
  return y;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt) {
  return quant_linear_parts(x, {blocks}, {fmt});
}

// The weights ``blocks`` (uint8 [N_p, row_bytes_p], GGML types ``fmts``) of K inputs each, dequantized
// into ``out`` float32 [sum of N_p, K] (contiguous), stacked in order: each weight by its format's
// ``decode``, the reference's values bit for bit. For many rows (a prefill) the caller then multiplies
// by torch's GEMM: one decode of each weight, where the row passes above decode it once per pass.
void quant_dequantize(at::TensorList blocks, at::IntArrayRef fmts, const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "quant_dequantize: out float32 [N, K], contiguous");
  const int64_t K = out.size(1);
  const Weights ws(blocks, fmts, K, "quant_dequantize");
  TORCH_CHECK(out.size(0) == ws.features(), "quant_dequantize: out has ", out.size(0), " rows for ", ws.features(),
              " output features");
  float* op = out.data_ptr<float>();
  at::parallel_for(0, ws.features(), kGrain, [&](int64_t n0, int64_t n1) {
    ws.each(n0, n1, [&](auto f, size_t p, int64_t a, int64_t b) {
      using F = typename decltype(f)::type;
      const Part& q = ws.parts[p];
      for (int64_t n = a; n < b; ++n) {
        float* w = op + (ws.start[p] + n) * K;
        for (int64_t k0 = 0; k0 < K; k0 += F::kWeights)
          F::decode(q.w + n * q.row_bytes + k0 / F::kWeights * F::kBytes,
                    [&](int off, vec v) { specdec_vec::store(w + k0 + off, v); });
      }
    });
  });
}

}  // namespace

SPECDEC_FRAGMENT(SPECDEC_OPS, m) {
  m.def("quant_linear(Tensor x, Tensor blocks, int fmt) -> Tensor");
  m.def("quant_linear_parts(Tensor x, Tensor[] blocks, int[] fmts) -> Tensor");
  m.def("quant_dequantize(Tensor[] blocks, int[] fmts, Tensor(a!) out) -> ()");
}
SPECDEC_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_parts", &quant_linear_parts);
  m.impl("quant_dequantize", &quant_dequantize);
}
