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
// Threads split (sequence, head, row) items, never a row's keys.
// Floating-point expressions are computed as written (no FMA contraction): the AVX2 and native builds, and the
// kernel's instances per head size, then round alike.
#pragma GCC optimize("fp-contract=off")
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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
#endif

constexpr float kMasked = -1e30f;  // a bias at or below this hides its key (HF's masks use the dtype's min)

#if defined(__AVX2__)

inline float dot(const float* a, const float* b, int64_t D) {  // D a multiple of 8
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum8(acc);
}

// e^x of n values in place, in whole vectors of vec.h's width and the tail through one padded vector: the
// same function of each value wherever it sits
void exp_inplace(float* s, int64_t n) {
  using namespace specdec_vec;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(s + i, vexp(load(s + i)));
  if (i < n) {
    float tmp[kLanes] = {};
    std::memcpy(tmp, s + i, (n - i) * sizeof(float));
    store(tmp, vexp(load(tmp)));
    std::memcpy(s + i, tmp, (n - i) * sizeof(float));
  }
}

struct Scratch {
  std::vector<float> s;        // [L] scores of the visible keys, in order
  std::vector<int64_t> j;      // [L] their key indices
  std::vector<float> q, acc;   // [D] the scaled query, the weighted values
};

// the weighted values of a row's n visible keys (rank r: key j[r], weight p[r]) in rank order, D / 8 lanes of
// 8 floats each accumulating one FMA per key: with D known at compile time the lanes stay in registers
template <int D>
inline void weigh_values(const float* p, const int64_t* j, int64_t n, const float* v, int64_t vs, float l, float* out) {
  __m256 acc[D / 8];
  for (int d = 0; d < D / 8; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t r = 0; r < n; ++r) {
    const __m256 w = _mm256_set1_ps(p[r]);
    const float* vr = v + j[r] * vs;
    for (int d = 0; d < D / 8; ++d) acc[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * d), acc[d]);
  }
  const __m256 lv = _mm256_set1_ps(l);
  for (int d = 0; d < D / 8; ++d) _mm256_storeu_ps(out + 8 * d, _mm256_div_ps(acc[d], lv));
}

// any D (a multiple of 8): the same operations, the lanes in scratch memory
inline void weigh_values_any(const float* p, const int64_t* j, int64_t n, const float* v, int64_t vs, int64_t D,
                             float l, float* acc, float* out) {
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, _mm256_setzero_ps());
  for (int64_t r = 0; r < n; ++r) {
    const __m256 w = _mm256_set1_ps(p[r]);
    const float* vr = v + j[r] * vs;
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + d), _mm256_loadu_ps(acc + d)));
  }
  for (int64_t d = 0; d < D; ++d) out[d] = acc[d] / l;
}

// the dot products of the query with keys, in 8 lanes (lane i sums d = i, i + 8, ... in order) and one fixed
// horizontal sum; with D known at compile time the query stays in registers
template <int D>
inline float dot_q(const __m256* q, const float* k) {
  __m256 acc = _mm256_mul_ps(q[0], _mm256_loadu_ps(k));
  for (int d = 1; d < D / 8; ++d) acc = _mm256_fmadd_ps(q[d], _mm256_loadu_ps(k + 8 * d), acc);
  return hsum8(acc);
}

inline float dot_any(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
  for (int64_t i = 8; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum8(acc);
}

// 1. the visible keys' scores (compacted: rank order) -> their count
template <int D>
inline int64_t scores(const float* q, const float* k, int64_t ks, const float* bias, int64_t L, float scale,
                      Scratch& w) {
  __m256 qv[D > 0 ? D / 8 : 1];
  if constexpr (D > 0)
    for (int d = 0; d < D / 8; ++d) qv[d] = _mm256_loadu_ps(q + 8 * d);
  int64_t n = 0;
  for (int64_t j = 0; j < L; ++j) {
    const float b = bias == nullptr ? 0.f : bias[j];
    if (!(b > kMasked)) continue;  // masked (NaN included: never attended)
    float raw;
    if constexpr (D > 0)
      raw = dot_q<D>(qv, k + j * ks);
    else
      raw = dot_any(q, k + j * ks, w.q.size());
    w.s[n] = raw * scale + b;  // two roundings: the product, then the sum
    w.j[n] = j;
    ++n;
  }
  return n;
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

template <int D>
void one_row(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, const float* bias, int64_t L,
             int64_t Dr, float scale, float* out, Scratch& w) {
  const int64_t n = scores<D>(q, k, ks, bias, L, scale, w);
  if (n == 0) {  // nothing visible (a padding row): zeros, as a fully masked softmax row would be unused
    for (int64_t d = 0; d < Dr; ++d) out[d] = 0.f;
    return;
  }
  const float m = max_of(w.s.data(), n);  // 2. softmax over them
  for (int64_t i = 0; i < n; ++i) w.s[i] = w.s[i] - m;
  exp_inplace(w.s.data(), n);
  __m256 lanes = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(w.s.data() + i));
  float tail[8] = {};
  for (int64_t t = 0; i + t < n; ++t) tail[t] = w.s[i + t];
  lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(tail));
  const float l = hsum8(lanes);
  if constexpr (D > 0)  // 3. the values, in rank order
    weigh_values<D>(w.s.data(), w.j.data(), n, v, vs, l, out);
  else
    weigh_values_any(w.s.data(), w.j.data(), n, v, vs, Dr, l, w.acc.data(), out);
}

using RowFn = void (*)(const float*, const float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                       float, float*, Scratch&);

RowFn row_fn(int64_t D) {
  switch (D) {
    case 64: return &one_row<64>;
    case 128: return &one_row<128>;
    default: return &one_row<0>;
  }
}

#endif  // __AVX2__

// query [B, H, R, D], key / value [B, H, L, D] (rows contiguous: a store's views), bias additive
// [B or 1, 1, Q, L] with R a multiple of Q (row r uses bias row r % Q) or None -> [B, H, R, D]
at::Tensor row_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& bias, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "row_attention: 4-d query, key, value");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "row_attention: float32 only");
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
  const float* qp = qc.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks = key.stride(2);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs = value.stride(2);
  at::parallel_for(0, B * H * R, 1, [&](int64_t i0, int64_t i1) {
    Scratch w;
    w.s.resize(L);
    w.j.resize(L);
    w.q.resize(D);
    w.acc.resize(D);
    const RowFn one_row = row_fn(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * R), h = (i / R) % H, r = i % R;
      const float* brow = bp == nullptr ? nullptr : bp + b * bb + (r % Q) * bq;
      one_row(qp + i * D, kp + b * ks0 + h * ks1, ks, vp + b * vs0 + h * vs1, vs, brow, L, D,
              static_cast<float>(scale), op + i * D, w);
    }
  });
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
