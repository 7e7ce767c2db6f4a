// Attention one query row at a time, over the keys that row sees, in their order: the attention of a
// target in int8 numerics (docs/decisions/019-int8-numerics.md). A row's output depends only on its query
// and the sequence of keys its bias leaves visible, never on the other rows of the block, the masked or
// padded keys between, the store's length or the thread count; so a token verified in a block of drafts
// (its draft siblings masked out) gets the bits it gets decoded alone.
//   1. scores of the visible keys (a key whose bias is -inf or below -1e30, a dtype-min mask, is skipped:
//      it adds nothing, not even a rounding), each a dot product over D in 8-float lanes with one fixed
//      horizontal sum, times the scale, plus the bias;
//   2. their maximum (exact, order-free); p = e^(s - max) (vec.h's vexp on the compacted scores, so a
//      score's lane is its rank among the visible keys); their sum in 8 lanes by rank, one fixed reduce;
//   3. the values accumulated in rank order (one FMA per key and 8 floats of D), divided by the sum.
// With D = 64 or 128 a thread takes G rows of one head together (G = 1, 2 or 4 by the rows a head): each key
// and value vector it loads serves every row of the group, and each row's dot products with 4 keys run as
// independent chains (one key at a time, a row ran one latency-bound chain; decision 019). Each row's
// operations stay the ones above, in the same order, whichever rows share its group.
// Threads split (sequence, head, row group) items, never a row's keys.
// Keys and values come as the store holds them: fp32, or bf16 (int8 numerics' store) widened exactly to fp32
// as they are loaded, so the arithmetic above is the same on either.
// Floating-point expressions are computed as written (no FMA contraction): the AVX2 and native builds, and the
// kernel's instances per head size, then round alike.
#pragma GCC optimize("fp-contract=off")
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

#if defined(__AVX2__)
using specdec_vec::hmax8;
using specdec_vec::hsum8;
using specdec_vec::hsum8x4;
using specdec_vec::load8;
#endif

constexpr float kMasked = -1e30f;  // a bias at or below this hides its key (HF's masks use the dtype's min)

#if defined(__AVX2__)

// e^(x - m) of n values in place, in whole vectors of vec.h's width and the tail through one padded vector:
// the same function of each value wherever it sits
void exp_shifted(float* s, int64_t n, float m) {
  using namespace specdec_vec;
  const vec mv = splat(m);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(s + i, vexp(load(s + i) - mv));
  if (i < n) {
    float tmp[kLanes] = {};
    std::memcpy(tmp, s + i, (n - i) * sizeof(float));
    store(tmp, vexp(load(tmp) - mv));
    std::memcpy(s + i, tmp, (n - i) * sizeof(float));
  }
}

struct Scratch {
  std::vector<float> s;        // [L] scores of the visible keys, in order
  std::vector<int64_t> j;      // [L] their key indices
  std::vector<float> acc;      // [D] the weighted values
};

// the weighted values of a row's n visible keys (rank r: key j[r], weight p[r]) in rank order, D / 8 lanes of
// 8 floats each accumulating one FMA per key
template <typename T>
inline void weigh_values_any(const float* p, const int64_t* j, int64_t n, const T* v, int64_t vs, int64_t D,
                             float l, float* acc, float* out) {
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, _mm256_setzero_ps());
  for (int64_t r = 0; r < n; ++r) {
    const __m256 w = _mm256_set1_ps(p[r]);
    const T* vr = v + j[r] * vs;
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(w, load8(vr + d), _mm256_loadu_ps(acc + d)));
  }
  for (int64_t d = 0; d < D; ++d) out[d] = acc[d] / l;
}

// the dot product of a query with a key: a product, FMAs over D in 8 lanes (lane i sums d = i, i + 8, ... in
// order) and hsum8's fixed horizontal sum
template <typename T>
inline float dot_any(const float* a, const T* b, int64_t D) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), load8(b));
  for (int64_t i = 8; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  return hsum8(acc);
}

// the maximum of n >= 1 scores, 8 lanes at a time (the maximum is exact in any order; a NaN score, which no
// finite query and key give, may then be kept or dropped)
inline float max_of(const float* s, int64_t n) {
  __m256 lanes = _mm256_set1_ps(s[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + i));
  float m = hmax8(lanes);
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// the sum of n scores in 8 lanes by rank and one fixed reduce
inline float sum_of(const float* s, int64_t n) {
  __m256 lanes = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(s + i));
  float tail[8] = {};
  for (int64_t t = 0; i + t < n; ++t) tail[t] = s[i + t];
  lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(tail));
  return hsum8(lanes);
}

// one row, any head size (a multiple of 8): the three steps above, one key at a time
template <typename T>
void one_row(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, const float* bias, int64_t L,
             int64_t D, float scale, float* out, Scratch& w) {
  int64_t n = 0;  // 1. the visible keys' scores, compacted (rank order)
  for (int64_t j = 0; j < L; ++j) {
    const float b = bias == nullptr ? 0.f : bias[j];
    if (!(b > kMasked)) continue;  // masked (NaN included: never attended)
    w.s[n] = dot_any(q, k + j * ks, D) * scale + b;  // two roundings: the product, then the sum
    w.j[n++] = j;
  }
  if (n == 0) {  // nothing visible (a padding row): zeros, as a fully masked softmax row would be unused
    for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
    return;
  }
  exp_shifted(w.s.data(), n, max_of(w.s.data(), n));  // 2. softmax over them
  weigh_values_any(w.s.data(), w.j.data(), n, v, vs, D, sum_of(w.s.data(), n), w.acc.data(), out);  // 3.
}

// Over a long context a step's keys and values come from memory, read once each and in order: from kFarKeys keys
// on, each key's and value's row is asked for kAhead keys before its turn (measured on one AMD EPYC: decision 019,
// "Tried and dropped"; below that the store sits in cache). A request changes no arithmetic: the same bits.
constexpr int64_t kAhead = 32, kFarKeys = 1024;

// ask for ``rows`` rows of ``bytes`` bytes each, ``stride`` elements apart from p, to be brought into the cache
template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int rows, int64_t bytes) {
  for (int r = 0; r < rows; ++r)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + r * stride) + b, _MM_HINT_T0);
}

// Head sizes 64 and 128: G rows of one head at a time (G = 1, 2 or 4; up to 2 on AVX2), their accumulators in
// registers (32 on AVX-512, 16 on AVX2); any G gives the same bits.
#if defined(__AVX512F__)
constexpr int kMaxGroup = 4, kAccs = 16;
#else
constexpr int kMaxGroup = 2, kAccs = 8;
#endif

struct GroupScratch {
  std::vector<float> s;        // [G, L] each row's visible scores, in order
  std::vector<int64_t> j;      // [L] the keys some row sees, in order
  std::vector<uint8_t> seen;   // [L] which rows see each of them (bit g: row g)
};

// the dot products of G queries with 4 keys (k0, k0 + ks, ...): raw[g] lane t = q[g] . key t, dot_any's
// operations (hsum8's sum by hsum8x4)
template <int D, int G, typename T>
__attribute__((always_inline)) inline void dots_4_keys(const float* const* q, const T* k0, int64_t ks,
                                                       __m128* raw) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g) {
    const __m256 q0 = _mm256_loadu_ps(q[g]);
    for (int t = 0; t < 4; ++t) acc[g][t] = _mm256_mul_ps(q0, load8(k0 + t * ks));
  }
  for (int d = 1; d < D / 8; ++d) {
    // each key and query vector loaded once into a register for its FMAs (the empty asm keeps the compiler
    // from folding the load into every FMA that uses it: then the loads, not the FMAs, bound the loop)
    __m256 kv[4];
    for (int t = 0; t < 4; ++t) {
      kv[t] = load8(k0 + t * ks + 8 * d);
      __asm__("" : "+v"(kv[t]));
    }
    for (int g = 0; g < G; ++g) {
      __m256 qd = _mm256_loadu_ps(q[g] + 8 * d);
      __asm__("" : "+v"(qd));
      for (int t = 0; t < 4; ++t) acc[g][t] = _mm256_fmadd_ps(qd, kv[t], acc[g][t]);
    }
  }
  for (int g = 0; g < G; ++g) raw[g] = hsum8x4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
}

// the same apart from its caller, for groups of 2 or 4: their accumulators, 4 key and a query vector then get the
// registers to themselves (inlined, GCC spilled accumulators to the stack, an FMA chain through memory; one row's
// fit beside the caller's, and its call would cost more than it saves)
template <int D, int G, typename T>
__attribute__((noinline)) void dots_4_keys_apart(const float* const* q, const T* k0, int64_t ks, __m128* raw) {
  dots_4_keys<D, G, T>(q, k0, ks, raw);
}

// the scores of G rows, 4 keys at a time (each key block loaded once for all the rows), times the scale plus
// the bias (two roundings, as one_row's); a key no row sees is skipped. -> the number of keys some row sees
// (w.j, w.seen); n[g]: row g's count; *shared: how many of the first keys every row sees (a row's rank there
// is the key's)
template <int D, int G, typename T>
int64_t group_scores(const float* const* q, const T* k, int64_t ks, const float* const* bias, int64_t L,
                     float scale, GroupScratch& w, int64_t* n, int64_t* shared) {
  constexpr unsigned kAll = (1u << G) - 1;
  const bool far = L >= kFarKeys;
  int64_t nu = 0, j = 0;
  bool all_so_far = true;
  for (int g = 0; g < G; ++g) n[g] = 0;
  *shared = 0;
  auto add_key = [&](int64_t key, unsigned seen) {
    all_so_far = all_so_far && seen == kAll;
    if (all_so_far) *shared = nu + 1;
    w.j[nu] = key;
    w.seen[nu++] = uint8_t(seen);
  };
  float* const s = w.s.data();
  const __m128 masked = _mm_set1_ps(kMasked), scale4 = _mm_set1_ps(scale);
  for (; j + 4 <= L; j += 4) {
    __m128 b[G];
    unsigned vis[G], any = 0, every = 0xF;
    for (int g = 0; g < G; ++g) {
      b[g] = bias[g] == nullptr ? _mm_setzero_ps() : _mm_loadu_ps(bias[g] + j);
      vis[g] = unsigned(_mm_movemask_ps(_mm_cmp_ps(b[g], masked, _CMP_GT_OQ)));  // NaN: never attended
      any |= vis[g];
      every &= vis[g];
    }
    if (!any) continue;
    if (far && j + kAhead + 4 <= L) prefetch_rows(k + (j + kAhead) * ks, ks, 4, D * sizeof(T));
    __m128 raw[G];
    if constexpr (G == 1)
      dots_4_keys<D, G, T>(q, k + j * ks, ks, raw);
    else
      dots_4_keys_apart<D, G, T>(q, k + j * ks, ks, raw);
    if (every == 0xF) {  // every row sees the 4 keys (most blocks)
      for (int g = 0; g < G; ++g) _mm_storeu_ps(s + g * L + n[g], _mm_add_ps(_mm_mul_ps(raw[g], scale4), b[g]));
      for (int g = 0; g < G; ++g) n[g] += 4;
      for (int t = 0; t < 4; ++t) {
        w.j[nu + t] = j + t;
        w.seen[nu + t] = uint8_t(kAll);
      }
      nu += 4;
      if (all_so_far) *shared = nu;
      continue;
    }
    for (int g = 0; g < G; ++g) {
      float lane[4];
      _mm_storeu_ps(lane, _mm_add_ps(_mm_mul_ps(raw[g], scale4), b[g]));
      for (int t = 0; t < 4; ++t)
        if (vis[g] >> t & 1) s[g * L + n[g]++] = lane[t];
    }
    for (int t = 0; t < 4; ++t) {
      unsigned seen = 0;
      for (int g = 0; g < G; ++g) seen |= (vis[g] >> t & 1u) << g;
      if (seen) add_key(j + t, seen);
    }
  }
  for (; j < L; ++j) {  // the last L % 4 keys one at a time
    unsigned seen = 0;
    for (int g = 0; g < G; ++g) {
      const float b = bias[g] == nullptr ? 0.f : bias[g][j];
      if (!(b > kMasked)) continue;
      s[g * L + n[g]++] = dot_any(q[g], k + j * ks, D) * scale + b;
      seen |= 1u << g;
    }
    if (seen) add_key(j, seen);
  }
  return nu;
}

// G rows of one head (query q[g], bias row bias[g], output out[g]): one_row's three steps, with the scores and
// the values of each key shared by the rows
template <int D, int G, typename T>
void row_group(const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs,
               const float* const* bias, int64_t L, float scale, float* const* out, GroupScratch& w) {
  constexpr int kChunk = std::min(D / 8, kAccs / G);  // vectors of D a pass over the keys accumulates
  int64_t n[G], shared;
  const int64_t nu = group_scores<D, G, T>(q, k, ks, bias, L, scale, w, n, &shared);
  const bool far = L >= kFarKeys;
  const float* p = w.s.data();
  float l[G];
  for (int g = 0; g < G; ++g) {  // 2. each row's softmax, as one_row's
    if (n[g] == 0) continue;
    float* s = w.s.data() + g * L;
    exp_shifted(s, n[g], max_of(s, n[g]));
    l[g] = sum_of(s, n[g]);
  }
  for (int c = 0; c < D / 8; c += kChunk) {  // 3. the values in rank order, kChunk vectors of D a pass
    __m256 acc[G][kChunk];
    for (int g = 0; g < G; ++g)
      for (int e = 0; e < kChunk; ++e) acc[g][e] = _mm256_setzero_ps();
    int64_t u = 0;
    for (; u < shared; ++u) {  // keys every row sees: a row's rank is u
      if (far && u + kAhead < nu) prefetch_rows(v + w.j[u + kAhead] * vs + 8 * c, vs, 1, 8 * kChunk * sizeof(T));
      const T* vr = v + w.j[u] * vs + 8 * c;
      __m256 vv[kChunk];
      for (int e = 0; e < kChunk; ++e) vv[e] = load8(vr + 8 * e);
      for (int g = 0; g < G; ++g) {
        const __m256 pg = _mm256_set1_ps(p[g * L + u]);
        for (int e = 0; e < kChunk; ++e) acc[g][e] = _mm256_fmadd_ps(pg, vv[e], acc[g][e]);
      }
    }
    int64_t rank[G];
    for (int g = 0; g < G; ++g) rank[g] = shared;
    for (; u < nu; ++u) {  // the rest: each row's own ranks
      if (far && u + kAhead < nu) prefetch_rows(v + w.j[u + kAhead] * vs + 8 * c, vs, 1, 8 * kChunk * sizeof(T));
      const T* vr = v + w.j[u] * vs + 8 * c;
      const unsigned seen = w.seen[u];
      for (int g = 0; g < G; ++g) {
        if (!(seen >> g & 1)) continue;
        const __m256 pg = _mm256_set1_ps(p[g * L + rank[g]++]);
        for (int e = 0; e < kChunk; ++e) acc[g][e] = _mm256_fmadd_ps(pg, load8(vr + 8 * e), acc[g][e]);
      }
    }
    for (int g = 0; g < G; ++g) {
      if (n[g] == 0) continue;
      const __m256 lv = _mm256_set1_ps(l[g]);
      for (int e = 0; e < kChunk; ++e) _mm256_storeu_ps(out[g] + 8 * (c + e), _mm256_div_ps(acc[g][e], lv));
    }
  }
  for (int g = 0; g < G; ++g)  // nothing visible (a padding row): zeros, as in one_row
    if (n[g] == 0)
      for (int64_t d = 0; d < D; ++d) out[g][d] = 0.f;
}

template <typename T>
using GroupFn = void (*)(const float* const*, const T*, int64_t, const T*, int64_t, const float* const*,
                         int64_t, float, float* const*, GroupScratch&);

template <int D, typename T>
GroupFn<T> group_fn_of(int G) {
  if (G >= kMaxGroup) return &row_group<D, kMaxGroup, T>;  // group_size gives at most kMaxGroup
  return G >= 2 ? &row_group<D, 2, T> : &row_group<D, 1, T>;
}

// the group size for R rows a head: the largest that repeats at most a quarter of them to fill its last group
// (a decode step's 3 grouped rows: 1, so the threads share 3 items a head, not 1 and a half)
int group_size(int64_t R) {
  for (int G = kMaxGroup; G > 1; G /= 2)
    if (4 * ((R + G - 1) / G * G - R) <= R) return G;
  return 1;
}

// row_attention's work over K/V of element type T (float, or uint16_t: bf16), into ``out``
template <typename T>
void attend(const at::Tensor& qc, const at::Tensor& key, const at::Tensor& value, const float* bp, int64_t bb,
            int64_t bq, int64_t Q, double scale, at::Tensor& out) {
  const int64_t B = qc.size(0), H = qc.size(1), R = qc.size(2), D = qc.size(3), L = key.size(2);
  const float* qp = qc.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(key.data_ptr());
  const T* vp = reinterpret_cast<const T*>(value.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks = key.stride(2);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs = value.stride(2);
  const float sc = static_cast<float>(scale);
  if (D == 64 || D == 128) {  // a head's rows in groups of G
    const int G = group_size(R);
    const GroupFn<T> row_group = D == 64 ? group_fn_of<64, T>(G) : group_fn_of<128, T>(G);
    const int64_t groups = (R + G - 1) / G;
    at::parallel_for(0, B * H * groups, 1, [&](int64_t i0, int64_t i1) {
      GroupScratch w;
      w.s.resize(G * L);
      w.j.resize(L);
      w.seen.resize(L);
      std::vector<float> spare(D);  // the output of a short group's repeated last row
      const float* q[kMaxGroup];
      const float* brow[kMaxGroup];
      float* o[kMaxGroup];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / (H * groups), h = (i / groups) % H, r0 = (i % groups) * G;
        for (int g = 0; g < G; ++g) {
          const int64_t r = std::min(r0 + g, R - 1);
          const int64_t row = (b * H + h) * R + r;
          q[g] = qp + row * D;
          brow[g] = bp == nullptr ? nullptr : bp + b * bb + (r % Q) * bq;
          o[g] = r0 + g < R ? op + row * D : spare.data();
        }
        row_group(q, kp + b * ks0 + h * ks1, ks, vp + b * vs0 + h * vs1, vs, brow, L, sc, o, w);
      }
    });
    return;
  }
  at::parallel_for(0, B * H * R, 1, [&](int64_t i0, int64_t i1) {
    Scratch w;
    w.s.resize(L);
    w.j.resize(L);
    w.acc.resize(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * R), h = (i / R) % H, r = i % R;
      const float* brow = bp == nullptr ? nullptr : bp + b * bb + (r % Q) * bq;
      one_row<T>(qp + i * D, kp + b * ks0 + h * ks1, ks, vp + b * vs0 + h * vs1, vs, brow, L, D, sc, op + i * D, w);
    }
  });
}
#endif  // __AVX2__

// query [B, H, R, D] float32, key / value [B, H, L, D] float32 or bf16 (rows contiguous: a store's views), bias additive
// [B or 1, 1, Q, L] with R a multiple of Q (row r uses bias row r % Q) or None -> [B, H, R, D]
at::Tensor row_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& bias, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "row_attention: 4-d query, key, value");
  TORCH_CHECK(query.scalar_type() == at::kFloat && value.scalar_type() == key.scalar_type() &&
                  (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16),
              "row_attention: a float32 query; key and value both float32 or both bfloat16 (a store's)");
  const int64_t B = query.size(0), H = query.size(1), R = query.size(2), D = query.size(3), L = key.size(2);
  TORCH_CHECK(key.size(0) == B && key.size(1) == H && key.size(3) == D && value.sizes() == key.sizes(),
              "row_attention: key / value [B, H, L, D] matching the query");
  TORCH_CHECK(D % 8 == 0, "row_attention: head size a multiple of 8");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "row_attention: key / value rows contiguous");
  const float* bp = nullptr;
  int64_t Q = R, bb = 0, bq = 0;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.dim() == 4 && bc.size(1) == 1 && bc.size(3) == L
                && (bc.size(0) == B || bc.size(0) == 1) && bc.size(2) >= 1 && R % bc.size(2) == 0,
                "row_attention: bias float32 [B or 1, 1, Q, L] with R a multiple of Q");
    Q = bc.size(2);
    bb = bc.size(0) == 1 ? 0 : Q * L;
    bq = L;
    bp = bc.data_ptr<float>();
  }
  const at::Tensor qc = query.contiguous();
  at::Tensor out = at::empty({B, H, R, D}, query.options());
#if defined(__AVX2__)
  if (key.scalar_type() == at::kBFloat16)
    attend<uint16_t>(qc, key, value, bp, bb, bq, Q, scale, out);
  else
    attend<float>(qc, key, value, bp, bb, bq, Q, scale, out);
#else
  TORCH_CHECK(false, "row_attention: this build has no AVX2");
#endif
  return out;
}

}  // namespace

SPECDEC_FRAGMENT(SPECDEC_OPS, m) {
  m.def("row_attention(Tensor query, Tensor key, Tensor value, Tensor? bias, float scale) -> Tensor");
}
SPECDEC_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) { m.impl("row_attention", &row_attention); }
