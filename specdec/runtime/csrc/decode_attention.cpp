// Attention of a few query rows (decode and verify blocks) over a KV store, streamed at memory speed.
//
// A decode or verify step attends 1-64 grouped query rows per KV head to the whole store: it reads
// every cached key and value once, so it should cost what streaming them from memory costs. torch's
// SDPA (its CPU flash kernel, and the matmul path alike) read them at ~12 GB/s on a Xeon whose memory
// streams at ~24 GB/s (B = 8 x 2,000 tokens, 30 layers of the default model: 50 ms against 25 ms of
// bytes; 2026-11-25, 2 threads). Here each (sequence, KV head, stretch of keys) is one work item of
// torch's thread pool (flash-decoding's split of the keys when there are fewer items than threads):
//   1. scores of every row for a tile of 64 keys, each key row loaded once (the rows pre-scaled),
//      plus the additive bias (row r uses bias row r % Q: grouped rows share their query position's
//      mask, so the caller does not repeat it). Under 12 rows each key row is dotted with every row
//      (attend_keys); from 12 rows on the rows are the vector lanes (attend_rows: no horizontal
//      sums; 16 rows x 200 keys ran at 0.75x SDPA's speed the other way, 1.15x this way);
//   2. an online softmax per row (running max and sum; earlier tiles rescaled when the max grows),
//      exp vectorised (Cephes' polynomial, ~1 ulp; below -87.3 it is exactly 0, so a dtype-min
//      bias hides a key exactly);
//   3. the tile's values, each loaded once per block of rows whose accumulators sit in registers.
// Items that split one head's keys are merged at the end by their maxima and sums.
// Same arithmetic as SDPA, another summation order: results agree with it to fp32 rounding.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers only
#include <ATen/core/Tensor.h>  // the Tensor, its methods, and each op used from its own header
                                // (ATen.h declares every op: docs/decisions/015-quant-kernels.md)
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace specdec_vec;

constexpr int kMaxRows = 64;  // grouped query rows per KV head (the caller falls back past this)
constexpr int kTile = 64;     // keys per tile: scores [rows, tile] stay in L1
constexpr int64_t kSplitKeys = 64;  // fewest keys worth a work item of their own (a tile)
constexpr int kLaneRows = 12;  // from this many rows on, the rows are the vector lanes (attend_rows)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <int D>
inline void prefetch_row(const float* p) {
#pragma GCC unroll 16
  for (int i = 0; i < D; i += 64 / sizeof(float)) __builtin_prefetch(p + i, 0, 2);  // into L2
}

struct Part {  // one work item's keys of one KV head: per row a running max, sum and weighted values
  float* m;    // [R]
  float* l;    // [R]
  float* acc;  // [R, D]
};

// 3. acc[r] += sum over the tile's keys jj of P(r, jj) * v[jj] for rows [0, R), P(r, jj) at
// p[r * rs + jj * js]: RB rows at a time, so each value row is loaded once per RB rows.
template <int NV>
inline void accumulate(const float* p, int64_t rs, int64_t js, int R, const float* v, int64_t vs, int nj,
                       float* acc) {
  constexpr int D = NV * kLanes;
  constexpr int RB = NV >= 16 ? 1 : 16 / NV > 4 ? 4 : 16 / NV;  // AVX-512, D = 64: 4 rows x 4 vectors
  int r0 = 0;
  for (; r0 + RB <= R; r0 += RB) {
    vec a[RB][NV];
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
      for (int t = 0; t < NV; ++t) a[i][t] = load(acc + (r0 + i) * D + t * kLanes);
    for (int jj = 0; jj < nj; ++jj) {
      const float* vr = v + jj * vs;
      float w[RB];
#pragma GCC unroll 4
      for (int i = 0; i < RB; ++i) w[i] = p[(r0 + i) * rs + jj * js];
#pragma GCC unroll 16
      for (int t = 0; t < NV; ++t) {
        const vec x = load(vr + t * kLanes);
#pragma GCC unroll 4
        for (int i = 0; i < RB; ++i) a[i][t] += x * w[i];
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
      for (int t = 0; t < NV; ++t) store(acc + (r0 + i) * D + t * kLanes, a[i][t]);
  }
  for (; r0 < R; ++r0) {
    vec a[NV];
#pragma GCC unroll 16
    for (int t = 0; t < NV; ++t) a[t] = load(acc + r0 * D + t * kLanes);
    for (int jj = 0; jj < nj; ++jj) {
      const float w = p[r0 * rs + jj * js];
#pragma GCC unroll 16
      for (int t = 0; t < NV; ++t) a[t] += load(v + jj * vs + t * kLanes) * w;
    }
#pragma GCC unroll 16
    for (int t = 0; t < NV; ++t) store(acc + r0 * D + t * kLanes, a[t]);
  }
}

inline void reset(Part out, int R, int D) {
  std::fill(out.m, out.m + R, kNegInf);
  std::fill(out.l, out.l + R, 0.f);
  std::fill(out.acc, out.acc + static_cast<int64_t>(R) * D, 0.f);
}

// Few rows (R < kLaneRows): scores S[r][key], each key row dotted with every row (one horizontal sum
// per score), the softmax per row over the tile's keys as vectors.
// Rows [0, R) of q ([R, D], pre-scaled) against keys [j0, j1) of one head: k/v rows `ks`/`vs` floats
// apart, bias row r at bias + (r % Q) * bs (nullptr: none). D = NV * kLanes.
template <int NV>
void attend_keys(const float* q, int R, const float* k, int64_t ks, const float* v, int64_t vs, const float* bias,
                 int64_t bs, int Q, int64_t j0, int64_t j1, Part out) {
  constexpr int D = NV * kLanes;
  alignas(64) float S[kLaneRows][kTile];
  reset(out, R, D);
  for (int64_t jt = j0; jt < j1; jt += kTile) {
    const int nj = static_cast<int>(std::min<int64_t>(kTile, j1 - jt));
    const int64_t next = std::min<int64_t>(kTile, j1 - jt - nj);  // keys in the next tile
    for (int jj = 0; jj < nj; ++jj) {  // 1. scores
      const float* kr = k + (jt + jj) * ks;
      // one core alone streams at a fraction of memory speed: fetch this tile's values (read in 3.)
      // and the next tile's keys while these keys are scored
      prefetch_row<D>(v + (jt + jj) * vs);
      if (jj < next) prefetch_row<D>(kr + kTile * ks);
      vec kv[NV];
#pragma GCC unroll 16
      for (int t = 0; t < NV; ++t) kv[t] = load(kr + t * kLanes);
      for (int r = 0; r < R; ++r) {
        const float* qr = q + r * D;
        vec a = load(qr) * kv[0];
#pragma GCC unroll 16
        for (int t = 1; t < NV; ++t) a += load(qr + t * kLanes) * kv[t];
        S[r][jj] = hsum(a);
      }
    }
    for (int r = 0; r < R; ++r) {  // 2. online softmax
      float* s = S[r];
      if (bias != nullptr) {
        const float* b = bias + static_cast<int64_t>(r % Q) * bs + jt;
        for (int jj = 0; jj < nj; ++jj) s[jj] += b[jj];
      }
      for (int jj = nj; jj < kTile; ++jj) s[jj] = kNegInf;
      vec mv = load(s);
      for (int jj = kLanes; jj < kTile; jj += kLanes) {
        const vec x = load(s + jj);
        mv = x > mv ? x : mv;
      }
      const float mt = std::max(out.m[r], hmax(mv));
      if (mt == kNegInf) {  // every key so far hidden by a -inf bias: nothing to weigh yet
        std::fill(s, s + kTile, 0.f);
        continue;
      }
      const float c = out.m[r] == kNegInf ? 0.f : std::exp(out.m[r] - mt);
      out.m[r] = mt;
      vec sum{};
      for (int jj = 0; jj < kTile; jj += kLanes) {
        const vec p = vexp(load(s + jj) - mt);
        store(s + jj, p);
        sum += p;
      }
      out.l[r] = out.l[r] * c + hsum(sum);
      if (c != 1.f) {
        float* a = out.acc + r * D;
        for (int t = 0; t < NV; ++t) store(a + t * kLanes, load(a + t * kLanes) * c);
      }
    }
    accumulate<NV>(&S[0][0], kTile, 1, R, v + jt * vs, vs, nj, out.acc);  // 3. values
  }
}

// Scores of keys [0, nj) of a tile for all rows as lanes: St[key][row] = Qt^T k + Bt[key][row] (Bt may
// be null), mt[u] = the running max of lane vector u. KG keys at a time, so that KG x (RV + H)
// accumulator chains hide the FMA latency (one key at a time, 64 dependent FMAs per score vector, ran at
// a third of the speed) and each Qt load serves KG keys. RV full vectors of rows, then with H (AVX-512)
// one of 8 lanes for rows RV * 16 .. + 7: 17-24 rows (a verify of 6-8 positions of 3 grouped heads) take
// 16 + 8 lanes, not 32 (docs/decisions/003-attention-kernel.md); its lanes' arithmetic is the same, so
// its scores are the 16-lane shape's bit for bit. Lanes 8-15 of that last vector are left as they are
// in St and mt.
#if defined(__AVX512F__)
typedef float hvec __attribute__((vector_size(8 * sizeof(float))));
#else
typedef vec hvec;  // unused: no half vectors at 8 lanes
#endif

template <int D, int RV, bool H>
inline void scores_lanes(const float (*Qt)[kMaxRows], const float* k, int64_t ks, const float* v, int64_t vs,
                         int nj, int64_t next, const float (*Bt)[kMaxRows], float (*St)[kMaxRows], vec* mt) {
  constexpr int KG = std::max(1, std::min(4, (kLanes == 16 ? 16 : 8) / (RV + H)));
  constexpr int NA = RV > 0 ? RV : 1;  // arrays of at least one (RV = 0 only with H)
  hvec hm = hvec{} + kNegInf;  // the half vector's running max (unused without H)
  int jj = 0;
  auto group = [&](auto kg) {
    constexpr int G = decltype(kg)::value;
    for (int g = 0; g < G; ++g) {
      prefetch_row<D>(v + (jj + g) * vs);
      if (jj + g < next) prefetch_row<D>(k + (jj + g + kTile) * ks);
    }
    vec a[G][NA];
    hvec ah[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
      for (int u = 0; u < RV; ++u) a[g][u] = Bt != nullptr ? load(Bt[jj + g] + u * kLanes) : vec{};
      if constexpr (H) {
        ah[g] = hvec{};
        if (Bt != nullptr) std::memcpy(&ah[g], Bt[jj + g] + RV * kLanes, sizeof(hvec));
      }
    }
    for (int d = 0; d < D; ++d) {
#pragma GCC unroll 8
      for (int u = 0; u < RV; ++u) {
        const vec qv = load(Qt[d] + u * kLanes);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) a[g][u] += qv * k[(jj + g) * ks + d];
      }
      if constexpr (H) {
        hvec qh;
        std::memcpy(&qh, Qt[d] + RV * kLanes, sizeof(hvec));
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) ah[g] += qh * k[(jj + g) * ks + d];
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
      for (int u = 0; u < RV; ++u) {
        store(St[jj + g] + u * kLanes, a[g][u]);
        mt[u] = a[g][u] > mt[u] ? a[g][u] : mt[u];
      }
      if constexpr (H) {
        std::memcpy(St[jj + g] + RV * kLanes, &ah[g], sizeof(hvec));
        hm = ah[g] > hm ? ah[g] : hm;
      }
    }
  };
  for (; jj + KG <= nj; jj += KG) group(std::integral_constant<int, KG>{});
  for (; jj < nj; ++jj) group(std::integral_constant<int, 1>{});
  if constexpr (H) {  // the half vector's max into lanes 0-7 of mt[RV]
    alignas(64) float m[kLanes];
    store(m, mt[RV]);
    for (int i = 0; i < 8; ++i) m[i] = std::max(m[i], hm[i]);
    mt[RV] = load(m);
  }
}

template <int D>
inline void scores_by_rows(int R, const float (*Qt)[kMaxRows], const float* k, int64_t ks, const float* v,
                           int64_t vs, int nj, int64_t next, const float (*Bt)[kMaxRows], float (*St)[kMaxRows],
                           vec* mt) {
  const int RV = (R + kLanes - 1) / kLanes;
#if defined(__AVX512F__)
  if (R % kLanes != 0 && R % kLanes <= 8) {  // the last vector's rows fit 8 lanes
    switch (RV) {
      case 1: return scores_lanes<D, 0, true>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
      case 2: return scores_lanes<D, 1, true>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
      case 3: return scores_lanes<D, 2, true>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
      case 4: return scores_lanes<D, 3, true>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
    }
  }
#endif
  switch (RV) {
    case 1: return scores_lanes<D, 1, false>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
    case 2: return scores_lanes<D, 2, false>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
    case 3: return scores_lanes<D, 3, false>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
    case 4: return scores_lanes<D, 4, false>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
#if !defined(__AVX512F__)
    case 5: return scores_lanes<D, 5, false>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
    case 6: return scores_lanes<D, 6, false>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
    case 7: return scores_lanes<D, 7, false>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
    case 8: return scores_lanes<D, 8, false>(Qt, k, ks, v, vs, nj, next, Bt, St, mt);
#endif
  }
}

// Many rows (R >= kLaneRows): the rows are the vector lanes. q is transposed once ([D][RP], RP = R
// padded to vectors); each key's scores for all rows are RP / L vectors, built by broadcasting the
// key's features (no horizontal sums, no transposed keys), kept as St[key][row]; the running max and
// sum are vectors over the rows too, and the bias is laid out [key][row] per tile.
template <int NV>
void attend_rows(const float* q, int R, const float* k, int64_t ks, const float* v, int64_t vs, const float* bias,
                 int64_t bs, int Q, int64_t j0, int64_t j1, Part out) {
  constexpr int D = NV * kLanes;
  constexpr int RVmax = kMaxRows / kLanes;
  const int RV = (R + kLanes - 1) / kLanes, RP = RV * kLanes;
  alignas(64) float Qt[D][kMaxRows];
  alignas(64) float St[kTile][kMaxRows];
  alignas(64) float Bt[kTile][kMaxRows];
  for (int jj = 0; jj < kTile; ++jj)  // the padding lanes' bias and scores: 0, not stack garbage
    for (int r = R; r < RP; ++r) Bt[jj][r] = St[jj][r] = 0.f;  // (denormals are slow; a half vector leaves St's)
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < RP; ++r) Qt[d][r] = r < R ? q[r * D + d] : 0.f;
  vec m[RVmax], l[RVmax];
  for (int u = 0; u < RV; ++u) m[u] = splat(kNegInf), l[u] = vec{};
  reset(out, R, D);
  for (int64_t jt = j0; jt < j1; jt += kTile) {
    const int nj = static_cast<int>(std::min<int64_t>(kTile, j1 - jt));
    const int64_t next = std::min<int64_t>(kTile, j1 - jt - nj);
    if (bias != nullptr) {
      for (int r = 0; r < R; ++r) {
        const float* b = bias + static_cast<int64_t>(r % Q) * bs + jt;
        for (int jj = 0; jj < nj; ++jj) Bt[jj][r] = b[jj];
      }
    }
    vec mt[RVmax];
    for (int u = 0; u < RV; ++u) mt[u] = splat(kNegInf);
    scores_by_rows<D>(R, Qt, k + jt * ks, ks, v + jt * vs, vs, nj, next, bias != nullptr ? Bt : nullptr, St, mt);
    alignas(64) float c[kMaxRows];
    for (int u = 0; u < RV; ++u) {  // 2. online softmax, all rows at once
      const vec mn = m[u] > mt[u] ? m[u] : mt[u];
      const vec safe = mn == splat(kNegInf) ? vec{} : mn;  // rows with every key hidden so far weigh 0
      const vec cu = vexp(m[u] - safe);
      vec sum{};
      for (int jj = 0; jj < nj; ++jj) {
        const vec p = vexp(load(St[jj] + u * kLanes) - safe);
        store(St[jj] + u * kLanes, p);
        sum += p;
      }
      l[u] = l[u] * cu + sum;
      m[u] = mn;
      store(c + u * kLanes, cu);
    }
    for (int r = 0; r < R; ++r) {
      if (c[r] != 1.f) {
        float* a = out.acc + r * D;
        for (int t = 0; t < NV; ++t) store(a + t * kLanes, load(a + t * kLanes) * c[r]);
      }
    }
    accumulate<NV>(&St[0][0], 1, kMaxRows, R, v + jt * vs, vs, nj, out.acc);  // 3. values
  }
  alignas(64) float mr[kMaxRows], lr[kMaxRows];
  for (int u = 0; u < RV; ++u) store(mr + u * kLanes, m[u]), store(lr + u * kLanes, l[u]);
  std::copy(mr, mr + R, out.m);
  std::copy(lr, lr + R, out.l);
}

template <int NV>
void attend(const float* q, int R, const float* k, int64_t ks, const float* v, int64_t vs, const float* bias,
            int64_t bs, int Q, int64_t j0, int64_t j1, Part out) {
  (R < kLaneRows ? attend_keys<NV> : attend_rows<NV>)(q, R, k, ks, v, vs, bias, bs, Q, j0, j1, out);
}

using AttendFn = void (*)(const float*, int, const float*, int64_t, const float*, int64_t, const float*, int64_t,
                          int, int64_t, int64_t, Part);

AttendFn pick(int64_t D) {
  switch (D / kLanes) {
    case 1: return attend<1>;
    case 2: return attend<2>;
    case 4: return attend<4>;
    case 8: return attend<8>;
    case 16: return attend<16>;
    default: return nullptr;
  }
}

// Whether D (head size) has a shape here: 1, 2, 4, 8 or 16 vectors.
bool supports(int64_t D) { return D % kLanes == 0 && pick(D) != nullptr; }

// q [B, H, R, D] (R grouped rows per KV head), k/v [B, H, L, D] (any strides but the last: views of a
// store), bias [B or 1, 1, Q or 1, L] additive or None (row r uses bias row r % Q). -> [B, H, R, D]
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& bias, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k, v [B, H, rows, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attention: float32 only");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(),
              "attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not match");
  TORCH_CHECK(1 <= R && R <= kMaxRows, "attention: 1 to ", kMaxRows, " rows per head, got ", R);
  TORCH_CHECK(L >= 1, "attention: no keys");
  TORCH_CHECK(supports(D), "attention: head size ", D, " is not 1, 2, 4, 8 or 16 vectors of ", kLanes);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attention: k and v rows must be contiguous");
  const float* bp = nullptr;
  int64_t b_batch = 0, b_row = 0;
  int Q = 1;
  at::Tensor bc;
  if (bias.has_value()) {
    bc = *bias;
    TORCH_CHECK(bc.dim() == 4 && bc.size(1) == 1 && bc.size(3) == L && (bc.size(0) == B || bc.size(0) == 1),
                "attention: bias [B, 1, Q, L], got ", bc.sizes(), " for ", L, " keys");
    TORCH_CHECK(bc.scalar_type() == at::kFloat, "attention: a float32 bias");
    if (bc.stride(3) != 1) bc = bc.contiguous();
    Q = static_cast<int>(bc.size(2));
    TORCH_CHECK(R % Q == 0, "attention: ", R, " rows are not a multiple of the bias's ", Q);
    bp = bc.data_ptr<float>();
    b_batch = bc.size(0) == 1 ? 0 : bc.stride(0);
    b_row = bc.stride(2);
  }
  // q * scale as torch computes it (the scalar rounded to float, one product a value), into a buffer of
  // our own: no op dispatched and no tensor allocated for it (015, Decision: per-call costs)
  const at::Tensor qc = q.contiguous();
  std::vector<float> qs(static_cast<size_t>(qc.numel()));
  const float s = static_cast<float>(scale);
  const float* q0 = qc.data_ptr<float>();
  for (size_t i = 0; i < qs.size(); ++i) qs[i] = q0[i] * s;
  at::Tensor out = at::empty({B, H, R, D}, q.options());
  const int64_t threads = at::get_num_threads();
  // splits of each head's keys: enough items for the threads, none shorter than kSplitKeys
  const int64_t want = std::max<int64_t>(1, (2 * threads + B * H - 1) / (B * H));
  const int64_t splits = std::max<int64_t>(1, std::min(want, L / kSplitKeys));
  const int64_t per = (L + splits - 1) / splits;
  const int64_t items = B * H * splits;
  std::vector<float> scratch(static_cast<size_t>(items * R * (D + 2)));
  const AttendFn fn = pick(D);
  const float* qp = qs.data();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bh = i / splits, s = i % splits, b = bh / H, h = bh % H;
      const int64_t j0 = s * per, j1 = std::min(L, j0 + per);
      float* base = scratch.data() + i * R * (D + 2);
      const Part part{base, base + R, base + 2 * R};
      if (j0 < j1) {
        fn(qp + bh * R * D, static_cast<int>(R), kp + b * k.stride(0) + h * k.stride(1), k.stride(2),
           vp + b * v.stride(0) + h * v.stride(1), v.stride(2), bp ? bp + b * b_batch : nullptr, b_row, Q, j0, j1,
           part);
      } else {
        std::fill(part.m, part.m + R, kNegInf);
        std::fill(part.l, part.l + R, 0.f);
      }
    }
  });
  for (int64_t bh = 0; bh < B * H; ++bh) {  // merge the splits of each head, normalise
    for (int64_t r = 0; r < R; ++r) {
      float m = kNegInf;
      for (int64_t s = 0; s < splits; ++s) m = std::max(m, scratch[(bh * splits + s) * R * (D + 2) + r]);
      float l = 0.f;
      float* o = op + (bh * R + r) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t s = 0; s < splits; ++s) {
        const float* base = scratch.data() + (bh * splits + s) * R * (D + 2);
        if (base[r] == kNegInf) continue;
        const float w = splits == 1 ? 1.f : std::exp(base[r] - m);
        l += base[R + r] * w;
        const float* a = base + 2 * R + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] += a[d] * w;
      }
      const float inv = 1.f / l;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
  return out;
}

bool attention_supports(int64_t D) { return supports(D); }

}  // namespace

SPECDEC_FRAGMENT(SPECDEC_OPS, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale) -> Tensor");
  m.def("attention_supports(int d) -> bool", &attention_supports);  // whether head size d has a shape
}
SPECDEC_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) { m.impl("attention", &attention); }
