// Vector helpers shared by the CPU kernels (GCC vector extensions: one register of floats per vec).
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace specdec_vec {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));

static inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

static inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(vec)); }

static inline vec splat(float x) { return vec{} + x; }

// fp32 -> bf16 rounded to nearest even, as torch's copy_ rounds (a NaN as its vectorized path writes it): the one
// rounding of an int8 target's bf16 K/V store (csrc/layers.cpp's write, BMCLayer.update's) and of the prompt
// attention's operands
static inline uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return f != f ? uint16_t(0xFFFF) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float hsum(vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX2__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(reinterpret_cast<__m256>(v)),
                        _mm256_extractf128_ps(reinterpret_cast<__m256>(v), 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

#if defined(__AVX2__)
// the sum of 8 floats in one fixed order: the int8 kernels' horizontal sum (a row's value does not
// depend on the build's vector width)
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the horizontal sums of 4 vectors [sum(a), sum(b), sum(c), sum(d)], each with hsum8's order
// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)): the same bits as 4 hsum8 calls, in fewer shuffles
static inline __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
  // halves: [a0 + a4 .. a3 + a7 | b0 + b4 .. b3 + b7], and c, d alike
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  // pairs: [a's h0 + h2, h1 + h3, c's h0 + h2, h1 + h3 | b's, d's]
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  // the last sum: [a, c, a, c | b, d, b, d]
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// 8 keys' or values' floats from a store: fp32 as held, or bf16 (a store in int8 numerics holds K/V as the
// upper halves of fp32: docs/decisions/019-int8-numerics.md) widened exactly
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// the maximum of 8 floats (exact in any order)
static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

static inline float hmax(vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

// e^x per lane (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n);
// exactly 0 below -87.3 (-inf included), where e^x is under float's smallest normal.
static inline vec vexp(vec x) {
  const vec lo = splat(-87.3365447505531f), hi = splat(88.3762626647949f);
  const vec xc = x < lo ? lo : (x > hi ? hi : x);
  const vec magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const vec t = xc * 1.44269504088896341f + magic;
  const vec n = t - magic;
  const vec r = xc - n * 0.693359375f - n * -2.12194440e-4f;
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  ivec bits = reinterpret_cast<ivec>(t) - reinterpret_cast<ivec>(magic);  // n as an integer
  bits = (bits + 127) << 23;
  const vec y = p * reinterpret_cast<vec>(bits);
  return x < lo ? vec{} : y;
}

#if defined(__F16C__)
// f16 -> fp32 through a table of all 65,536 values (256 KB, filled when the library loads; one table for
// every source: an inline variable; a model's scales touch a few lines of it): a block's scale then reaches a
// vector register by a broadcast from memory, a load, where converting it (vpinsrw, vcvtph2ps, vbroadcastss)
// takes the shuffle port that the lookups (vpermps) and half the FMAs also need. The same value as
// _cvtsh_ss, bit for bit.
alignas(64) inline float kHalf[1 << 16];
inline const bool kHalfFilled = [] {
  for (int h = 0; h < (1 << 16); ++h) kHalf[h] = _cvtsh_ss(static_cast<uint16_t>(h));
  return true;
}();

static inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return kHalf[h];
}
#endif

}  // namespace specdec_vec
