// The small ops between a decoder layer's matmuls, one op each instead of 5-15 of torch's.
//
// A decode or verify step of the default model (30 layers, 576 features) spends its time streaming
// weights through the linears and ~6 ms of a ~30 ms step (the Xeon, 1 row, 2026-11-25) in the ops
// between them: RMSNorm as HF writes it (8 ops), the q/k/v split, views and rotary embedding (~15),
// the residual adds and SiLU x up. Each is a few hundred floats of work, but each is a Python call
// and a dispatch whose code and data the weight stream has just pushed out of the caches: 5-7 us an
// op in place (1-2 us in a loop). For the lean forward (specdec/fastpath.py):
//   rms_norm(x, w, eps)          w * (x * 1 / sqrt(mean(x^2) + eps)) per row, fp32 statistics;
//   add_rms_norm(x, d, w, eps)   (x + d, rms_norm(x + d)): the residual add and the next norm;
//   rope_split(qkv, cos, sin, hq, hkv)  a fused q/k/v projection's rows split into q [B, hq, Q, D],
//                                k and v [B, hkv, Q, D] (contiguous), q and k rotated as HF's
//                                apply_rotary_pos_emb does: x * cos + rotate_half(x) * sin;
//   silu_mul(gu)                 silu(g) * u for the fused gate/up output [..., 2I] -> [..., I];
//   argmax_rows(x)               each row's first maximum (a greedy verify's and a draft's next tokens);
//   mask_rows_(x, bits)          -inf in place where a grammar's packed bitmask forbids a token (constrained rows).
// Blocks of many rows (a prompt's) are split over torch's threads by rows, at least kGrainFloats of work a
// thread (a decode or verify step's few rows stay on one: a fork costs more than they do); a row is computed
// by the same code wherever it lands, so the split changes no bit.
// Same formulas in the same order as HF's ops, compiled without contracting a * b + c into one FMA,
// so the rotary embedding is bit for bit torch's; the norm's sum of squares is added in another order
// and SiLU's exp is Cephes' (~1 ulp, torch's is Sleef's): those agree with torch to fp32 rounding,
// like the kernels' linears. Every row is computed alone, the same in a block of 1 or 16 rows.
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers only
#include <ATen/core/Tensor.h>  // the Tensor, its methods, and each op used from its own header
                                // (ATen.h declares every op: docs/decisions/015-quant-kernels.md)
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "ops.h"
#include "vec.h"

namespace {

using namespace specdec_vec;

constexpr int64_t kGrainFloats = 16384;  // a thread's least share of a split block (docs/decisions/004-lean-forward.md)

// fn(first, last) over rows [0, rows) of `width` floats each, split by rows where there is enough work
template <typename Fn>
void by_rows(int64_t rows, int64_t width, const Fn& fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(1, width)), fn);
}

void check(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              ": expected a contiguous float32 CPU tensor");
}

// out[j] = w[j] * (x[j] * r), r = 1 / sqrt(sum(x^2) / C + eps)
void rms_row(const float* x, const float* w, float* out, int64_t C, float eps) {
  vec acc{};
  int64_t j = 0;
  for (; j + kLanes <= C; j += kLanes) {
    const vec v = load(x + j);
    acc += v * v;
  }
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; j < C; ++j) s += x[j] * x[j];
  const float r = 1.f / std::sqrt(s / static_cast<float>(C) + eps);
  for (j = 0; j < C; ++j) out[j] = w[j] * (x[j] * r);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, "rms_norm x");
  check(w, "rms_norm w");
  const int64_t C = x.size(-1);
  TORCH_CHECK(w.numel() == C, "rms_norm: weight of ", w.numel(), " for ", C, " features");
  auto out = at::empty_like(x);
  const int64_t rows = C ? x.numel() / C : 0;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  by_rows(rows, C, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) rms_row(xp + i * C, wp, op + i * C, C, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d, const at::Tensor& w,
                                                double eps) {
  check(x, "add_rms_norm x");
  check(d, "add_rms_norm d");
  check(w, "add_rms_norm w");
  TORCH_CHECK(x.sizes() == d.sizes(), "add_rms_norm: shapes ", x.sizes(), " and ", d.sizes());
  const int64_t C = x.size(-1);
  TORCH_CHECK(w.numel() == C, "add_rms_norm: weight of ", w.numel(), " for ", C, " features");
  auto sum = at::empty_like(x), out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dp = d.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  by_rows(C ? x.numel() / C : 0, C, [&](int64_t i0, int64_t i1) {
    for (int64_t j = i0 * C; j < i1 * C; ++j) sp[j] = xp[j] + dp[j];
    for (int64_t i = i0; i < i1; ++i) rms_row(sp + i * C, wp, op + i * C, C, static_cast<float>(eps));
  });
  return {sum, out};
}

// heads [B, Q, H, D] read at row stride N from src -> dst [B, H, Q, D], rows t0 .. t1 of each sequence;
// rotated when cos != nullptr
void heads(const float* src, int64_t N, float* dst, int64_t B, int64_t Q, int64_t H, int64_t D,
           const float* cos, const float* sin, int64_t cs_batch, int64_t t0, int64_t t1) {
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = t0; t < t1; ++t) {
        const float* x = src + (b * Q + t) * N + h * D;
        float* y = dst + ((b * H + h) * Q + t) * D;
        if (cos == nullptr) {
          std::memcpy(y, x, D * sizeof(float));
          continue;
        }
        const float* c = cos + (b * cs_batch + t) * D;
        const float* s = sin + (b * cs_batch + t) * D;
        for (int64_t j = 0; j < half; ++j) y[j] = x[j] * c[j] + (-x[j + half]) * s[j];
        for (int64_t j = half; j < D; ++j) y[j] = x[j] * c[j] + x[j - half] * s[j];
      }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_split(const at::Tensor& qkv, const at::Tensor& cos,
                                                          const at::Tensor& sin, int64_t hq, int64_t hkv) {
  check(qkv, "rope_split qkv");
  check(cos, "rope_split cos");
  check(sin, "rope_split sin");
  TORCH_CHECK(qkv.dim() == 3 && cos.dim() == 3 && cos.sizes() == sin.sizes(), "rope_split: qkv [B, Q, N], cos and sin [B or 1, Q, D]");
  const int64_t B = qkv.size(0), Q = qkv.size(1), N = qkv.size(2), D = cos.size(2);
  TORCH_CHECK(D % 2 == 0 && N == (hq + 2 * hkv) * D && cos.size(1) == Q && (cos.size(0) == B || cos.size(0) == 1),
              "rope_split: qkv ", qkv.sizes(), " does not hold ", hq, " + 2 x ", hkv, " heads of cos ", cos.sizes());
  auto q = at::empty({B, hq, Q, D}, qkv.options());
  auto k = at::empty({B, hkv, Q, D}, qkv.options());
  auto v = at::empty({B, hkv, Q, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const int64_t cb = cos.size(0) == 1 ? 0 : Q;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  by_rows(Q, B * N, [&](int64_t t0, int64_t t1) {
    heads(src, N, qp, B, Q, hq, D, cp, sp, cb, t0, t1);
    heads(src + hq * D, N, kp, B, Q, hkv, D, cp, sp, cb, t0, t1);
    heads(src + (hq + hkv) * D, N, vp, B, Q, hkv, D, nullptr, nullptr, 0, t0, t1);
  });
  return {q, k, v};
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check(gu, "silu_mul");
  const int64_t I2 = gu.size(-1), I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0, "silu_mul: an odd last dimension ", I2);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gu.options());
  const int64_t rows = I2 ? gu.numel() / I2 : 0;
  const vec one = splat(1.f);
  const float* gp = gu.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  by_rows(rows, I, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* g = gp + i * I2;
      const float* u = g + I;
      float* y = yp + i * I;
      int64_t j = 0;
      for (; j + kLanes <= I; j += kLanes) {
        const vec x = load(g + j);
        store(y + j, x / (one + vexp(-x)) * load(u + j));
      }
      for (; j < I; ++j) y[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  });
  return out;
}

// argmax_rows: per row of x [..., V], the index of its first maximum, as torch.max(x, -1).indices gives it (a row
// with a NaN: its first NaN's, as torch's NaN-propagating max); why an op of our own: decision 015, Decision:
// greedy verify: argmax and walk.

// the lanes of one vector of x equal to b, as bits (lane l: bit l)
inline uint32_t equal_lanes(const float* x, float b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(b), _CMP_EQ_OQ);
#else
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), _mm256_set1_ps(b), _CMP_EQ_OQ)));
#endif
}

int64_t first_nan(const float* x) {
  for (int64_t i = 0;; ++i)
    if (x[i] != x[i]) return i;
}

int64_t argmax_row(const float* x, int64_t V) {
  // the maximum: four independent running maxima (one would wait on its own latency every vector)
  constexpr int64_t kStep = 4 * kLanes;
  int64_t j = 0;
  float best = x[0];
  if (V >= kStep) {
    vec m[4] = {load(x), load(x + kLanes), load(x + 2 * kLanes), load(x + 3 * kLanes)};
    ivec nan{};
    for (; j + kStep <= V; j += kStep)
      for (int u = 0; u < 4; ++u) {
        const vec v = load(x + j + u * kLanes);
        nan |= v != v;
        m[u] = v > m[u] ? v : m[u];
      }
    for (int l = 0; l < kLanes; ++l)
      if (nan[l]) return first_nan(x);
    for (int u = 1; u < 4; ++u) m[0] = m[u] > m[0] ? m[u] : m[0];
    best = hmax(m[0]);
  }
  for (; j < V; ++j) {
    if (x[j] != x[j]) return first_nan(x);
    best = x[j] > best ? x[j] : best;
  }
  // its first index
  for (j = 0; j + kLanes <= V; j += kLanes)
    if (const uint32_t eq = equal_lanes(x + j, best)) return j + __builtin_ctz(eq);
  for (; j < V; ++j)
    if (x[j] == best) return j;
  return 0;  // unreachable: best is one of the row's values
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check(x, "argmax_rows x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "argmax_rows: rows of at least one value, got ", x.sizes());
  const int64_t V = x.size(-1), rows = x.numel() / V;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = at::empty(sizes, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row(p + r * V, V);
  return out;
}

// mask_rows_: x [R, V] float32 and llguidance's bitmask bits [R, W] int32 (bit j of word w = token 32 w + j,
// W * 32 >= V): x[r, t] = -inf where that bit is 0, the other values untouched (masked_fill's result). Ours
// because torch's masked_fill over unpacked bools branches per value and llguidance's
// apply_token_bitmask_inplace has a fixed cost per call that a 1-row step feels (docs/decisions/020-constraints.md).
// A vector's lanes lie within one word (32 is a multiple of kLanes).
at::Tensor& mask_rows_(at::Tensor& x, const at::Tensor& bits) {
  check(x, "mask_rows_ x");
  TORCH_CHECK(x.dim() == 2 && bits.dim() == 2 && bits.scalar_type() == at::kInt && bits.is_contiguous() &&
                  bits.size(0) == x.size(0) && bits.size(1) * 32 >= x.size(1),
              "mask_rows_: x [R, V] float32 and bits [R, ceil(V / 32)] int32, got ", x.sizes(), " and ", bits.sizes());
  const int64_t R = x.size(0), V = x.size(1), W = bits.size(1);
  const float ninf = -std::numeric_limits<float>::infinity();
  ivec lane{};
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  for (int64_t r = 0; r < R; ++r) {
    float* row = x.data_ptr<float>() + r * V;
    const int32_t* words = bits.data_ptr<int32_t>() + r * W;
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) {
      const ivec on = ((ivec{} + words[j >> 5]) >> (lane + static_cast<int32_t>(j & 31))) & 1;
      store(row + j, on != 0 ? load(row + j) : splat(ninf));
    }
    for (; j < V; ++j)
      if (!((words[j >> 5] >> (j & 31)) & 1)) row[j] = ninf;
  }
  return x;
}

}  // namespace

SPECDEC_FRAGMENT(SPECDEC_OPS, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("mask_rows_(Tensor(a!) x, Tensor bits) -> Tensor(a!)");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor d, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_split(Tensor qkv, Tensor cos, Tensor sin, int hq, int hkv) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor gu) -> Tensor");
}
SPECDEC_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_split", &rope_split);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("mask_rows_", &mask_rows_);
}
