// y = x @ W^T in int8 numerics: x rounded per row to 8-bit blocks of 32, W's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K codes
// multiplied by them as integers (llama.cpp's arithmetic), fp32 scales. The one int8 kernel: a target
// loaded with numerics="int8" runs every row through it (decode, verify, batches, prefill), and the
// self-speculative drafters' approximate forwards over an exact target take it too (int8_linear.approximate).
//
// The arithmetic, per (row r, feature n), blocks b of 32 weights in file order (docs/decisions/019-int8-numerics.md):
//   - each row is rounded alone (round_rows: per block of 32, dx = max|x| / 127, xq = nearbyint(x * (127 / max|x|)),
//     sx = dx * sum(xq));
//   - dot = the block's exact int32 dot product of codes and xq (Q4: codes 0..15; Q8_0: signed codes);
//   - acc = fma(float(dot), D * dx, acc), with D * dx one fp32 product;
//   - off = fma(M, sx, off);
//   - y = acc + off;
// where w = D q + M: Q4_1's D = d, M = m; Q4_0's D = d, M = -8 d; Q8_0's D = d (no M); Q4_K's and Q5_K's per
// sub-block of 32, D = d * sc, M = 0 - dmin * mn (exact fp32 products of an f16 and a 6-bit integer).
// Q6_K's sub-blocks are 16 weights, w = D (q - 32) with D = d * sc (sc a signed byte): per sub-block of 16,
//   - dot = dot(q, xq) - 32 * sum(xq over those 16), exact int32 (round_rows keeps n16 = -32 * sum);
//   - acc = fma(float(dot), D * dx, acc), dx its block of 32's; no off.
// Every path computes exactly these operations, so a row's outputs are the same bits whatever the number
// of rows M, the row's place among them, the thread count (threads split output features, never the sum
// over K), the layout of the blocks and the build (AVX-512 VNNI, AVX-VNNI or AVX2's vpmaddubsw +
// vpmaddwd: the same integers). Tests: tests/test_int8_numerics.py.
//
// Two layouts (a part's format code says which):
//   - the file's: one feature's blocks after another (GGML's rows);
//   - interleaved (code | kInterleaved; int8_linear.interleave builds it for a target in int8 numerics):
//     features in groups of 16, a group's blocks in file order, each block of the group stored as the 16
//     scales (f16), Q4_1's 16 mins (f16), then the codes as vectors of 64 bytes: vector j holds 4 codes
//     of each of the 16 features (Q4: bytes 4j..4j+3 of each feature's 16 nibble bytes, whose low nibbles
//     are weights 4j..4j+3 and high ones 16+4j..; Q8_0: codes 4j..4j+3 plus 128, as unsigned bytes).
//     Q4_K's 256-weight block: 16 d, 16 dmin (f16), its 8 sub-blocks' scales then mins as bytes (16 per
//     sub-block), then per pair of sub-blocks 8 such vectors (low nibbles: the pair's first sub-block).
//     Q5_K's: the same head and low nibbles, then 8 vectors of the codes' fifth bits (sub-block s at bit s;
//     180 bytes a feature and 256 weights against the file's 176). Q6_K's: 16 d (f16), its 16
//     sub-blocks' signed scales (16 bytes each), then its codes (0..63) as planes of the same vectors: per
//     pair of sub-blocks of 16 weights 4 vectors of low nibbles (the pair's first sub-block low), then per 4
//     sub-blocks 4 vectors of the codes' top 2 bits (sub-block t of the 4 at bits 2t); the file's 210 bytes.
//     Features past the last whole group keep the file's layout at their own offsets. One 512-bit
//     vpdpbusd against a broadcast of 4 of the row's codes then adds 4 products for each of 16 features:
//     the block's 16 dot products come out per lane, with no horizontal sum, and the float work of a
//     block is one convert, one product and two FMAs for the 16 (the reason for the layout).
#pragma GCC optimize("fp-contract=off")
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

constexpr int64_t kRowBlock = 64;  // rows whose rounded activations stay in L2 while a thread's features pass
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;  // GGML types
constexpr int kInterleaved = 0x100;                         // format flag: the part's blocks are interleaved
constexpr int kGroup = 16;                                  // features per interleaved group
constexpr int64_t kQ4KRowBytes = 148;  // an interleaved Q4_K copy's bytes per feature and 256 weights (file: 144)
constexpr int64_t kQ5KRowBytes = 180;  // Q5_K's (file: 176)
constexpr int64_t kQ6KRowBytes = 210;  // Q6_K's (file: 210)
constexpr int64_t kQ6KLow = 288, kQ6KTop = 288 + 2048;  // a Q6_K group block's low-nibble and top-bit planes

constexpr bool k_type(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }  // 256-weight blocks
constexpr int64_t block_bytes(int type) {  // the file's bytes per block (32 weights, or 256 for the K types)
  return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ4_K ? 144 : type == kQ5_K ? 176 : type == kQ6_K ? 210 : 34;
}
constexpr int64_t interleaved_bytes(int type) {  // an interleaved copy's bytes per feature and block
  return type == kQ4_K ? kQ4KRowBytes : type == kQ5_K ? kQ5KRowBytes : type == kQ6_K ? kQ6KRowBytes : block_bytes(type);
}

// a part's bytes per output feature for K inputs, in the file's layout or the interleaved one
constexpr int64_t row_bytes(int type, bool interleaved, int64_t K) {
  return K / (k_type(type) ? 256 : 32) * (interleaved ? interleaved_bytes(type) : block_bytes(type));
}

#if defined(__AVX2__)

using specdec_vec::f16;
using specdec_vec::hmax8;

struct Rounded {  // every row of x rounded: codes [M, K]; per [M, K / 32]: dx, sx = dx * sum(xq), -128 * sum(xq);
  std::vector<int8_t> q;  // per [M, K / 16]: n16 = -32 * sum(xq) (Q6_K's offset, in integers)
  std::vector<float> d, s;
  std::vector<int32_t> neg, n16;
};

inline int32_t sum1(__m256i a) {  // the 8 int32 lanes' sum (exact)
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

// one block of 32 values: amax = max |x|, inv = 127 / amax (0 for a block of zeros), xq = nearbyint(x * inv) as
// the rounding mode rounds (to nearest, ties to even: cvtps rounds as nearbyint does), the codes stored at q, and
// the sums of the first and of all 16 + 16 codes (exact integers). 8 lanes a vector, so both builds run this one
// path; whole vectors, not a scalar loop: a scalar loop's int8 stores alias everything, which keeps the compiler
// from vectorizing it (docs/decisions/019-int8-numerics.md, "Rounding the rows in whole vectors").
inline void round_block(const float* xb, int8_t* q, float& d, int32_t& half, int32_t& sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(xb + 8 * j);
    m = _mm256_max_ps(m, _mm256_and_ps(v[j], magnitude));
  }
  const float amax = hmax8(m);
  d = amax / 127.f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i c[4];
  for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // in [-127, 127]
  half = sum1(_mm256_add_epi32(c[0], c[1]));
  sum = half + sum1(_mm256_add_epi32(c[2], c[3]));
  // int32 -> int8 in order: the packs work per 128-bit half, so lanes come out as 0-3 8-11 16-19 24-27 4-7 ...
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

void round_rows(const float* x, int64_t M, int64_t K, Rounded& r) {
  const int64_t nb = K / 32;
  r.q.resize(M * K);
  r.d.resize(M * nb);
  r.s.resize(M * nb);
  r.neg.resize(M * nb);
  r.n16.resize(M * nb * 2);
  int8_t* q = r.q.data();
  float *d = r.d.data(), *s = r.s.data();
  int32_t *neg = r.neg.data(), *n16 = r.n16.data();
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * nb; i < m1 * nb; ++i) {  // block i: row i / nb, its block i % nb
      int32_t half, sum;
      round_block(x + i * 32, q + i * 32, d[i], half, sum);
      n16[2 * i] = -32 * half;
      n16[2 * i + 1] = -32 * (sum - half);
      s[i] = d[i] * static_cast<float>(sum);
      neg[i] = -128 * sum;
    }
  });
}

inline int32_t word(const int8_t* p) {  // 4 codes as one int32 (the broadcast operand)
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// sum over groups of 4 of u8 x s8 products into the int32 lanes of acc (no saturation: for Q4 codes
// |a pair's products| < 2^15; Q8_0 takes dot_q8 on AVX2)
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Q8_0 codes stored plus 128 (u, unsigned) times s: dot(u - 128, s) added to acc, as exact integers
inline __m256i dot_q8(__m256i acc, __m256i u, __m256i s) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  // acc starts at -128 * sum(s) for the block (the caller's), so the biased products come out exact
  return dot_u8s8(acc, u, s);
#else
  const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));  // the signed codes
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(s, q)),
                             _mm256_set1_epi16(1)));
#endif
}
constexpr bool kQ8Biased =
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    true;
#else
    false;
#endif

// a Q4 block's 16 bytes of nibbles -> its 32 codes in weight order (low nibbles are weights 0-15)
inline __m256i nibbles(const uint8_t* q) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// ---- the file's layout: G features a tile, their 8-lane dot vectors reduced together ----

// the block dots of 4 features (8 int32 lanes each) -> their 4 sums, in order
inline __m128i sum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// y[r, f] for R rows x G (4 or 1) features in the file's layout: rows r0..r0+R of x, features at w, w + rb, ...
template <int Type, int R, int G>
inline void tile(const uint8_t* w, int64_t rb, int64_t nb, const Rounded& x, int64_t K, int64_t r0, float* y,
                 int64_t N) {
  static_assert(G == 4 || G == 1, "tiles of 4 features or 1");
  constexpr int64_t kBytes = block_bytes(Type);
  __m128 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps(), off[r] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i c[G];
    alignas(16) float d[4] = {0.f, 0.f, 0.f, 0.f}, m[4] = {0.f, 0.f, 0.f, 0.f};
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = w + g * rb + b * kBytes;
      d[g] = f16(blk);
      m[g] = Type == kQ4_1 ? f16(blk + 2) : Type == kQ4_0 ? -8.f * d[g] : 0.f;
      if constexpr (Type == kQ8_0)
        c[g] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)),
                                _mm256_set1_epi8(static_cast<char>(0x80)));
      else
        c[g] = nibbles(blk + (Type == kQ4_1 ? 4 : 2));
    }
    const __m128 dv = _mm_load_ps(d), mv = _mm_load_ps(m);
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + row * K + b * 32));
      const __m256i start = _mm256_set1_epi32(Type == kQ8_0 && kQ8Biased ? x.neg[row * nb + b] : 0);
      __m256i dot[G];
      for (int g = 0; g < G; ++g) {
        // the bias -128 * sum(xq) in one lane only: the lanes' sum is the block's dot
        const __m256i s0 = Type == kQ8_0 && kQ8Biased ? _mm256_blend_epi32(_mm256_setzero_si256(), start, 1)
                                                      : _mm256_setzero_si256();
        dot[g] = Type == kQ8_0 ? dot_q8(s0, c[g], xv) : dot_u8s8(s0, c[g], xv);
      }
      const float dx = x.d[row * nb + b], sx = x.s[row * nb + b];
      if constexpr (G == 4) {
        const __m128 f = _mm_cvtepi32_ps(sum4(dot[0], dot[1], dot[2], dot[3]));
        acc[r] = _mm_fmadd_ps(f, _mm_mul_ps(dv, _mm_set1_ps(dx)), acc[r]);
        if constexpr (Type != kQ8_0) off[r] = _mm_fmadd_ps(mv, _mm_set1_ps(sx), off[r]);
      } else {
        const float f = static_cast<float>(sum1(dot[0]));
        acc[r][0] = std::fma(f, d[0] * dx, acc[r][0]);
        if constexpr (Type != kQ8_0) off[r][0] = std::fma(m[0], sx, off[r][0]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float out[4];
    _mm_store_ps(out, _mm_add_ps(acc[r], off[r]));
    for (int g = 0; g < G; ++g) y[(r0 + r) * N + g] = out[g];
  }
}

template <int Type, int G>
inline void rows_tile(const uint8_t* w, int64_t rb, int64_t nb, const Rounded& x, int64_t K, int64_t a, int64_t b,
                      float* y, int64_t N) {
  int64_t r = a;
  for (; r + 2 <= b; r += 2) tile<Type, 2, G>(w, rb, nb, x, K, r, y, N);
  if (r < b) tile<Type, 1, G>(w, rb, nb, x, K, r, y, N);
}

// features [a, b) of one weight in the file's layout (y: its first output column, row stride N), every row
template <int Type>
void feature_range(const uint8_t* w, int64_t rb, int64_t nb, const Rounded& x, int64_t M, int64_t K, float* y,
                   int64_t N, int64_t a, int64_t b) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    int64_t n = a;
    for (; n + 4 <= b; n += 4) {
      if (n + 8 <= b)  // the next tile's blocks, while this one is multiplied
        for (int64_t i = 0; i < 4 * rb; i += 64) __builtin_prefetch(w + (n + 4) * rb + i, 0, 2);
      rows_tile<Type, 4>(w + n * rb, rb, nb, x, K, m0, m1, y + n, N);
    }
    for (; n < b; ++n) rows_tile<Type, 1>(w + n * rb, rb, nb, x, K, m0, m1, y + n, N);
  }
}

// ---- the interleaved layout: a group of 16 features, R rows ----

constexpr int64_t scale_bytes(int type) { return type == kQ4_1 ? 64 : 32; }  // the group's f16 d (and m)
constexpr int64_t kQ4KCodes = 320;  // a Q4_K / Q5_K group block's codes start past its d, dmin, sc, mn

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

constexpr int kGroupRows = 8;
// tiles of this many rows or more fetch a group's blocks kAhead ahead of the one multiplied (Q4_K: 2 of 256
// weights); 1-row tiles, memory-bound, leave it to the hardware (docs/decisions/019-int8-numerics.md)
constexpr int kPrefetchRows = 4;
// ... but Q5_K's and Q6_K's at every tile size: their loops do more work per byte and would leave too few loads
// in flight (docs/decisions/019-int8-numerics.md, the Q4_K_M row; Q4_K is slower with it)
constexpr int prefetch_rows(int type) { return type == kQ5_K || type == kQ6_K ? 1 : kPrefetchRows; }
constexpr int64_t kAhead = 8;

// one 32-weight block b of a group for R rows: codes c (16 features x 32, as 8 vectors of 4 codes each),
// scales d and offsets m per feature (the file's comment: one convert, one product, two FMAs per row)
template <int Type, int R>
inline void rows_step(__m512 (&acc)[R], __m512 (&off)[R], const __m512i (&c)[8], __m512 d, __m512 m,
                      const Rounded& x, int64_t K, int64_t nb, int64_t r0, int64_t b) {
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const int8_t* xr = x.q.data() + row * K + b * 32;
    __m512i s0 = Type == kQ8_0 ? _mm512_set1_epi32(x.neg[row * nb + b]) : _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) s0 = _mm512_dpbusd_epi32(s0, c[j], _mm512_set1_epi32(word(xr + 4 * j)));
    const __m512 f = _mm512_cvtepi32_ps(s0);
    acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(x.d[row * nb + b])), acc[r]);
    if constexpr (Type != kQ8_0) off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[row * nb + b]), off[r]);
  }
}

// Q6_K: one sub-block t (16 weights; its index over the row) of a group for R rows: codes c (16 features x 16,
// as 4 vectors of 4 codes each), D = d * sc per feature; the dots start at n16 = -32 * sum(xq) (the file's comment)
template <int R>
inline void rows_step16(__m512 (&acc)[R], const __m512i (&c)[4], __m512 D, const Rounded& x, int64_t K, int64_t nb,
                        int64_t r0, int64_t t) {
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const int8_t* xr = x.q.data() + row * K + t * 16;
    __m512i s0 = _mm512_set1_epi32(x.n16[row * nb * 2 + t]);
    for (int j = 0; j < 4; ++j) s0 = _mm512_dpbusd_epi32(s0, c[j], _mm512_set1_epi32(word(xr + 4 * j)));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(D, _mm512_set1_ps(x.d[row * nb + t / 2])), acc[r]);
  }
}

inline __m512 half16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 bytes16(const uint8_t* p) {  // 16 unsigned bytes as floats
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 signed16(const uint8_t* p) {  // 16 signed bytes as floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int Type, int R>
inline void group_tile(const uint8_t* grp, int64_t nb, const Rounded& x, int64_t K, int64_t r0, float* y,
                       int64_t N) {
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), off[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i c[8];
  if constexpr (Type == kQ4_K || Type == kQ5_K) {  // one head and nibbles; Q5_K's fifth bits after them
    constexpr int64_t kStride = kGroup * interleaved_bytes(Type);
    const __m512i one = _mm512_set1_epi8(1);
    for (int64_t B = 0; B < nb / 8; ++B) {
      const uint8_t* p = grp + B * kStride;
      if constexpr (R >= prefetch_rows(Type))
        for (int64_t o = 0; o < kStride; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p + 2 * kStride + o), _MM_HINT_T0);
      const __m512 d = half16(p), dmin = half16(p + 32);
      for (int s = 0; s < 8; ++s) {
        const uint8_t* cp = p + kQ4KCodes + 512 * (s / 2);  // sub-block s: the low nibbles of pair s / 2, or its high ones
        for (int j = 0; j < 8; ++j) {
          const __m512i v = _mm512_loadu_si512(cp + 64 * j);
          c[j] = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(v, 4) : v, low);
          if constexpr (Type == kQ5_K) {  // | fifth bit << 4 (masked first: no carry between bytes)
            const __m512i hb = _mm512_loadu_si512(p + kQ4KCodes + 2048 + 64 * j);
            c[j] = _mm512_or_si512(c[j], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, s), one), 4));
          }
        }
        const __m512 D = _mm512_mul_ps(d, bytes16(p + 64 + 16 * s));
        const __m512 M = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, bytes16(p + 192 + 16 * s)));
        rows_step<Type, R>(acc, off, c, D, M, x, K, nb, r0, B * 8 + s);
      }
    }
  } else if constexpr (Type == kQ6_K) {  // 16 d, 16 x 16 signed scales, the codes' planes
    constexpr int64_t kStride = kGroup * kQ6KRowBytes;
    const __m512i three = _mm512_set1_epi8(3);
    __m512i c4[4];
    for (int64_t B = 0; B < nb / 8; ++B) {
      const uint8_t* p = grp + B * kStride;
      if constexpr (R >= prefetch_rows(Type))
        for (int64_t o = 0; o < kStride; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p + 2 * kStride + o), _MM_HINT_T0);
      const __m512 d = half16(p);
      for (int t = 0; t < 16; ++t) {
        for (int j = 0; j < 4; ++j) {  // code = low nibble | top 2 bits << 4 (no carry between bytes: both masked)
          const __m512i lo = _mm512_loadu_si512(p + kQ6KLow + 256 * (t / 2) + 64 * j);
          const __m512i top = _mm512_loadu_si512(p + kQ6KTop + 256 * (t / 4) + 64 * j);
          c4[j] = _mm512_or_si512(_mm512_and_si512(t % 2 ? _mm512_srli_epi16(lo, 4) : lo, low),
                                  _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 2 * (t % 4)), three), 4));
        }
        rows_step16<R>(acc, c4, _mm512_mul_ps(d, signed16(p + 32 + 16 * t)), x, K, nb, r0, B * 16 + t);
      }
    }
  } else {
    constexpr int64_t kStride = kGroup * block_bytes(Type);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = grp + b * kStride;
      if constexpr (R >= kPrefetchRows)
        for (int64_t o = 0; o < kStride; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * kStride + o), _MM_HINT_T0);
      const __m512 d = half16(p);
      __m512 m = _mm512_setzero_ps();
      if constexpr (Type == kQ4_1) m = half16(p + 32);
      if constexpr (Type == kQ4_0) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
      const uint8_t* cp = p + scale_bytes(Type);
      if constexpr (Type == kQ8_0) {
        for (int j = 0; j < 8; ++j) c[j] = _mm512_loadu_si512(cp + 64 * j);
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(cp + 64 * j);
          c[j] = _mm512_and_si512(v, low);
          c[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
      }
      rows_step<Type, R>(acc, off, c, d, m, x, K, nb, r0, b);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * N, _mm512_add_ps(acc[r], off[r]));
}

#else  // AVX2 (or AVX-512 without VNNI): the group as two halves of 8 features, 256-bit

constexpr int kGroupRows = 4;

// one 32-weight block b of a half group for R rows: codes (8 features x 32, as 8 vectors of 4 codes each)
template <int Type, int R>
inline void rows_step(__m256 (&acc)[R], __m256 (&off)[R], const uint8_t (&codes)[8][32], __m256 d, __m256 m,
                      const Rounded& x, int64_t K, int64_t nb, int64_t r0, int64_t b) {
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const int8_t* xr = x.q.data() + row * K + b * 32;
    __m256i s0 = Type == kQ8_0 && kQ8Biased ? _mm256_set1_epi32(x.neg[row * nb + b]) : _mm256_setzero_si256();
    __m256i s1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
      const __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j]));
      const __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j + 1]));
      const __m256i x0 = _mm256_set1_epi32(word(xr + 4 * j)), x1 = _mm256_set1_epi32(word(xr + 4 * j + 4));
      s0 = Type == kQ8_0 ? dot_q8(s0, c0, x0) : dot_u8s8(s0, c0, x0);
      s1 = Type == kQ8_0 ? dot_q8(s1, c1, x1) : dot_u8s8(s1, c1, x1);
    }
    const __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
    acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(x.d[row * nb + b])), acc[r]);
    if constexpr (Type != kQ8_0) off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[row * nb + b]), off[r]);
  }
}

// Q6_K: one sub-block t of a half group for R rows: codes (8 features x 16, as 4 vectors of 4 codes each)
template <int R>
inline void rows_step16(__m256 (&acc)[R], const uint8_t (&codes)[8][32], __m256 D, const Rounded& x, int64_t K,
                        int64_t nb, int64_t r0, int64_t t) {
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const int8_t* xr = x.q.data() + row * K + t * 16;
    __m256i s0 = _mm256_set1_epi32(x.n16[row * nb * 2 + t]), s1 = _mm256_setzero_si256();
    for (int j = 0; j < 4; j += 2) {
      const __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j]));
      const __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j + 1]));
      s0 = dot_u8s8(s0, c0, _mm256_set1_epi32(word(xr + 4 * j)));
      s1 = dot_u8s8(s1, c1, _mm256_set1_epi32(word(xr + 4 * j + 4)));
    }
    const __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
    acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(D, _mm256_set1_ps(x.d[row * nb + t / 2])), acc[r]);
  }
}

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 bytes8(const uint8_t* p) {  // 8 unsigned bytes as floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 signed8(const uint8_t* p) {  // 8 signed bytes as floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int Type, int R>
inline void group_tile(const uint8_t* grp, int64_t nb, const Rounded& x, int64_t K, int64_t r0, float* y,
                       int64_t N) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  alignas(32) uint8_t codes[8][32];  // a half group's codes of one block, decoded once for the tile's rows
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R], off[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), off[r] = _mm256_setzero_ps();
    if constexpr (Type == kQ4_K || Type == kQ5_K) {  // one head and nibbles; Q5_K's fifth bits after them
      for (int64_t B = 0; B < nb / 8; ++B) {
        const uint8_t* p = grp + B * kGroup * interleaved_bytes(Type);
        const __m256 d = half8(p + 16 * h), dmin = half8(p + 32 + 16 * h);
        for (int s = 0; s < 8; ++s) {
          const uint8_t* cp = p + kQ4KCodes + 512 * (s / 2) + 32 * h;
          for (int j = 0; j < 8; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * j));
            __m256i c = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, low);
            if constexpr (Type == kQ5_K) {
              const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kQ4KCodes + 2048 + 64 * j + 32 * h));
              c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, s), _mm256_set1_epi8(1)), 4));
            }
            _mm256_store_si256(reinterpret_cast<__m256i*>(codes[j]), c);
          }
          const __m256 D = _mm256_mul_ps(d, bytes8(p + 64 + 16 * s + 8 * h));
          const __m256 M = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, bytes8(p + 192 + 16 * s + 8 * h)));
          rows_step<Type, R>(acc, off, codes, D, M, x, K, nb, r0, B * 8 + s);
        }
      }
    } else if constexpr (Type == kQ6_K) {
      for (int64_t B = 0; B < nb / 8; ++B) {
        const uint8_t* p = grp + B * kGroup * kQ6KRowBytes;
        const __m256 d = half8(p + 16 * h);
        for (int t = 0; t < 16; ++t) {
          for (int j = 0; j < 4; ++j) {
            const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kQ6KLow + 256 * (t / 2) + 64 * j + 32 * h));
            const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kQ6KTop + 256 * (t / 4) + 64 * j + 32 * h));
            const __m256i c = _mm256_or_si256(
                _mm256_and_si256(t % 2 ? _mm256_srli_epi16(lo, 4) : lo, low),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(top, 2 * (t % 4)), _mm256_set1_epi8(3)), 4));
            _mm256_store_si256(reinterpret_cast<__m256i*>(codes[j]), c);
          }
          rows_step16<R>(acc, codes, _mm256_mul_ps(d, signed8(p + 32 + 16 * t + 8 * h)), x, K, nb, r0, B * 16 + t);
        }
      }
    } else {
      constexpr int64_t kStride = kGroup * block_bytes(Type);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = grp + b * kStride;
        const __m256 d = half8(p + 16 * h);
        __m256 m = _mm256_setzero_ps();
        if constexpr (Type == kQ4_1) m = half8(p + 32 + 16 * h);
        if constexpr (Type == kQ4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
        const uint8_t* cp = p + scale_bytes(Type) + 32 * h;
        if constexpr (Type == kQ8_0) {
          for (int j = 0; j < 8; ++j) std::memcpy(codes[j], cp + 64 * j, 32);
        } else {
          for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * j));
            _mm256_store_si256(reinterpret_cast<__m256i*>(codes[j]), _mm256_and_si256(v, low));
            _mm256_store_si256(reinterpret_cast<__m256i*>(codes[j + 4]), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
          }
        }
        rows_step<Type, R>(acc, off, codes, d, m, x, K, nb, r0, b);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * N + 8 * h, _mm256_add_ps(acc[r], off[r]));
  }
}

#endif

// one interleaved group (16 features; y: its first output column) for rows [a, b)
template <int Type>
void group_rows(const uint8_t* grp, int64_t nb, const Rounded& x, int64_t K, int64_t a, int64_t b, float* y,
                int64_t N) {
  int64_t r = a;
  // the K formats in tiles of at most 4 rows: with 8, their sub-block scales and codes outgrow the registers
  // (docs/decisions/019-int8-numerics.md: the K formats in row tiles of 4)
  constexpr int kTile = Type == kQ4_K || Type == kQ5_K || Type == kQ6_K ? 4 : kGroupRows;
  for (; r + kTile <= b; r += kTile) group_tile<Type, kTile>(grp, nb, x, K, r, y, N);
  switch (b - r) {
    case 7: group_tile<Type, 7>(grp, nb, x, K, r, y, N); break;
    case 6: group_tile<Type, 6>(grp, nb, x, K, r, y, N); break;
    case 5: group_tile<Type, 5>(grp, nb, x, K, r, y, N); break;
    case 4: group_tile<Type, 4>(grp, nb, x, K, r, y, N); break;
    case 3: group_tile<Type, 3>(grp, nb, x, K, r, y, N); break;
    case 2: group_tile<Type, 2>(grp, nb, x, K, r, y, N); break;
    case 1: group_tile<Type, 1>(grp, nb, x, K, r, y, N); break;
    default: break;
  }
}

// sub-block s's 6-bit scale and min from a Q4_K / Q5_K block's 12 scale bytes sp (formats.k_scale_bytes)
inline int k_scale(const uint8_t* sp, int s) { return s < 4 ? sp[s] & 63 : (sp[s + 4] & 15) | ((sp[s - 4] >> 6) << 4); }
inline int k_min(const uint8_t* sp, int s) { return s < 4 ? sp[s + 4] & 63 : (sp[s + 4] >> 4) | ((sp[s] >> 6) << 4); }

// Q4_K features [a, b) in the file's layout (past an interleaved copy's last group, rows rb bytes apart): the
// same operations per (row, feature) as the group kernel, one sub-block of 32 at a time
void q4k_features(const uint8_t* w, int64_t rb, int64_t nb, const Rounded& x, int64_t M, int64_t K, float* y,
                  int64_t N, int64_t a, int64_t b) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t n = a; n < b; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f, off = 0.f;
      for (int64_t B = 0; B < nb / 8; ++B) {
        const uint8_t* blk = w + n * rb + B * 144;
        const uint8_t* sp = blk + 4;  // 12 bytes: 8 scales and 8 mins of 6 bits (k_scale, k_min)
        const float d = f16(blk), dmin = f16(blk + 2);
        for (int s = 0; s < 8; ++s) {
          const int sc = k_scale(sp, s), mn = k_min(sp, s);
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * (s / 2)));
          const __m256i codes = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, low);
          const int64_t sb = B * 8 + s;
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + m * K + sb * 32));
          const float f = static_cast<float>(sum1(dot_u8s8(_mm256_setzero_si256(), codes, xv)));
          const float D = d * static_cast<float>(sc), Mv = 0.f - dmin * static_cast<float>(mn);
          acc = std::fma(f, D * x.d[m * nb + sb], acc);
          off = std::fma(Mv, x.s[m * nb + sb], off);
        }
      }
      y[m * N + n] = acc + off;
    }
}

// Q5_K / Q6_K features [a, b) in the file's layout (past an interleaved copy's last group, rows rb bytes apart):
// the group kernel's operations per (row, feature), each sub-block's codes decoded to whole bytes first
// (specdec/formats.py's dequantize_q5_k / dequantize_q6_k say where each weight's bits are)
template <int Type>
void k_features(const uint8_t* w, int64_t rb, int64_t nb, const Rounded& x, int64_t M, int64_t K, float* y,
                int64_t N, int64_t a, int64_t b) {
  alignas(32) uint8_t codes[32];
  for (int64_t n = a; n < b; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f, off = 0.f;
      for (int64_t B = 0; B < nb / 8; ++B) {
        const uint8_t* blk = w + n * rb + B * block_bytes(Type);
        for (int k = 0; k < 8; ++k) {  // the block's k-th 32 weights: sub-block k (Q5_K), 2k and 2k + 1 (Q6_K)
          const int64_t sb = B * 8 + k;
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + m * K + sb * 32));
          if constexpr (Type == kQ5_K) {
            const uint8_t *sp = blk + 4, *qh = blk + 16, *qs = blk + 48;
            for (int l = 0; l < 32; ++l)
              codes[l] = static_cast<uint8_t>(((qs[32 * (k / 2) + l] >> (4 * (k % 2))) & 15) | (((qh[l] >> k) & 1) << 4));
            const int sc = k_scale(sp, k), mn = k_min(sp, k);
            const float d = f16(blk), dmin = f16(blk + 2);
            const __m256i cv = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes));
            const float f = static_cast<float>(sum1(dot_u8s8(_mm256_setzero_si256(), cv, xv)));
            const float D = d * static_cast<float>(sc), Mv = 0.f - dmin * static_cast<float>(mn);
            acc = std::fma(f, D * x.d[m * nb + sb], acc);
            off = std::fma(Mv, x.s[m * nb + sb], off);
          } else {
            const uint8_t *ql = blk, *qh = blk + 128;
            const int half = k / 4, quarter = k % 4;
            for (int l = 0; l < 32; ++l)
              codes[l] = static_cast<uint8_t>(((ql[64 * half + 32 * (quarter % 2) + l] >> (4 * (quarter / 2))) & 15) |
                                              (((qh[32 * half + l] >> (2 * quarter)) & 3) << 4));
            const float d = f16(blk + 208);
            for (int u = 0; u < 2; ++u) {  // the sub-block of 16: its codes, zeros beside them
              alignas(32) uint8_t one[32] = {};
              std::memcpy(one + 16 * u, codes + 16 * u, 16);
              const __m256i cv = _mm256_load_si256(reinterpret_cast<const __m256i*>(one));
              const int64_t t = B * 16 + 2 * k + u;
              const int32_t dot = sum1(dot_u8s8(_mm256_setzero_si256(), cv, xv)) + x.n16[m * nb * 2 + t];
              const float D = d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * k + u]));
              acc = std::fma(static_cast<float>(dot), D * x.d[m * nb + sb], acc);
            }
          }
        }
      }
      y[m * N + n] = acc + off;
    }
}

// features [16 u, 16 u + count) of one weight (a unit: an interleaved group, or file-layout features)
template <int Type>
void unit(const uint8_t* w, int64_t rb, int64_t nb, bool interleaved, const Rounded& x, int64_t M, int64_t K,
          float* y, int64_t N, int64_t first, int64_t count) {
  if (!interleaved || count < kGroup) {
    if constexpr (Type == kQ4_K)
      q4k_features(w, rb, nb, x, M, K, y, N, first, first + count);
    else if constexpr (Type == kQ5_K || Type == kQ6_K)
      k_features<Type>(w, rb, nb, x, M, K, y, N, first, first + count);
    else
      feature_range<Type>(w, rb, nb, x, M, K, y, N, first, first + count);
    return;
  }
  const uint8_t* grp = w + first * rb;  // a group's 16 rows of bytes, interleaved in place
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock)
    group_rows<Type>(grp, nb, x, K, m0, std::min(M, m0 + kRowBlock), y + first, N);
}

#endif  // __AVX2__

// x [M, K] (float32) through the weights ``blocks`` (uint8 [N_p, row_bytes_p] of GGML types ``fmts``: Q4_0,
// Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, each optionally | kInterleaved) -> [M, sum of N_p] float32, their outputs side by side, in
// int8 numerics (the file's comment)
at::Tensor quant_linear_i8(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef fmts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "quant_linear_i8: x float32 [M, K], K a multiple of 32");
  TORCH_CHECK(blocks.size() == fmts.size() && !blocks.empty(), "quant_linear_i8: one format per part");
#if defined(__AVX2__)
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  std::vector<int64_t> start{0}, units{0};  // per part: its first output feature, its first unit of 16
  for (size_t p = 0; p < blocks.size(); ++p) {
    const int64_t t = fmts[p] & ~kInterleaved;
    const bool inter = (fmts[p] & kInterleaved) != 0;
    TORCH_CHECK((fmts[p] & ~(kInterleaved | 0xFF)) == 0 && (t == kQ4_0 || t == kQ4_1 || t == kQ8_0 ||
                                                          (k_type(t) && K % 256 == 0)),
                "quant_linear_i8: format ", fmts[p], " is not Q4_0, Q4_1, Q8_0 or (K a multiple of 256) Q4_K, Q5_K, ",
                "Q6_K, optionally interleaved");
    TORCH_CHECK(blocks[p].scalar_type() == at::kByte && blocks[p].dim() == 2 && blocks[p].is_contiguous()
                && blocks[p].size(1) == row_bytes(t, inter, K), "quant_linear_i8: part ", p, " is not uint8 [N, ",
                row_bytes(t, inter, K), "]");
    start.push_back(start.back() + blocks[p].size(0));
    units.push_back(units.back() + (blocks[p].size(0) + kGroup - 1) / kGroup);
  }
  const int64_t N = start.back();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const at::Tensor xc = x.contiguous();
  Rounded rx;
  round_rows(xc.data_ptr<float>(), M, K, rx);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, units.back(), 1, [&](int64_t u0, int64_t u1) {
    size_t p = 0;
    for (int64_t u = u0; u < u1; ++u) {
      while (u >= units[p + 1]) ++p;
      const int64_t first = (u - units[p]) * kGroup, count = std::min<int64_t>(kGroup, blocks[p].size(0) - first);
      const uint8_t* w = blocks[p].data_ptr<uint8_t>();
      const int64_t rb = blocks[p].size(1);
      const bool inter = (fmts[p] & kInterleaved) != 0;
      float* yq = yp + start[p];
      switch (fmts[p] & ~kInterleaved) {
        case kQ4_0: unit<kQ4_0>(w, rb, nb, inter, rx, M, K, yq, N, first, count); break;
        case kQ4_1: unit<kQ4_1>(w, rb, nb, inter, rx, M, K, yq, N, first, count); break;
        case kQ4_K: unit<kQ4_K>(w, rb, nb, inter, rx, M, K, yq, N, first, count); break;
        case kQ5_K: unit<kQ5_K>(w, rb, nb, inter, rx, M, K, yq, N, first, count); break;
        case kQ6_K: unit<kQ6_K>(w, rb, nb, inter, rx, M, K, yq, N, first, count); break;
        default: unit<kQ8_0>(w, rb, nb, inter, rx, M, K, yq, N, first, count); break;
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
