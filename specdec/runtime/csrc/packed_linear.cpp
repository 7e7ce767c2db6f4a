// y = x @ w^T for 1-16 rows of x (verify blocks), from weights packed in panels of output features.
//
// A verify step multiplies a few rows by every weight matrix of the model, so it should cost what
// streaming the weights from memory costs. MKL's GEMM does not stream them at that rate for 1-16
// rows (see specdec/runtime/linear.py), so this kernel does: the weight is packed once into panels
// [P, K, L] (L output features side by side for each input feature, L = one vector register), so the
// inner loop reads one vector of weights per input feature and multiplies it with a broadcast of each
// row's input, accumulators in registers, no horizontal sums; R panels at a time share each broadcast.
//
// Shapes, picked at compile time by what the compiler targets (specdec/runtime/build.py builds with
// -march=native, or -march=x86-64-v3 for the AVX2 variant):
//   AVX-512 (32 vector registers): L = 16, and two shapes, both in the build, picked per call
//     (``wide``; specdec/runtime/calibrate.py times both once per process and keeps the faster per block size):
//     narrow: all M <= 16 rows in one pass over one panel at a time (tuned on a Zen 4);
//     wide: 3-12 rows over two panels side by side (one broadcast of each input feeds two FMAs:
//       2M + 2 + 1 <= 27 registers), 13-16 rows as two balanced passes of <= 8 (16 rows over two
//       panels would need 35 registers). On a Xeon (Sapphire Rapids class) the default model's
//       linears, narrow / wide: 8 rows 25.0 / 21.6 ms, 12 rows 28.1 / 22.7, 16 rows 30.2 / 28.9;
//       in L2, 16 rows ran at 250 / 310 GFLOPS of the two cores' ~320 (2026-11-25).
//   otherwise (AVX2: 16 registers):  L = 8, rows in balanced chunks of <= 8, R * chunk <= 12
//     accumulators + R weight vectors + 1 broadcast <= 16 registers, so nothing spills (7-8 rows:
//     one panel at a time in one pass beat two passes of 4 rows by 1.3-1.6x on a Zen 3). A 16-float
//     vector with up to 64 accumulators on AVX2 spilled every FMA: 8-15x slower than torch there.
//     ``wide`` is ignored.
//   The passes of one strip of panels re-read its weights from L1/L2, not from memory.
// The vectors are GCC vector extensions; threads are torch's own pool (at::parallel_for over strips
// of panels; built with -fopenmp, and the loader gives it the libgomp torch already loaded). Built
// on first use by torch.utils.cpp_extension, with a fallback to torch when no compiler is there;
// specdec/runtime/calibrate.py also times each shape against torch once per process and keeps torch's path for
// any block size where the kernel is slower.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers only
#include <ATen/core/Tensor.h>  // the Tensor, its methods, and each op used from its own header
                                // (ATen.h declares every op: docs/decisions/015-quant-kernels.md)
#include <ATen/ops/zeros.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "ops.h"

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // floats per vector register = output features per panel
constexpr bool kWide = true;  // the wide shape exists
#else
constexpr int kLanes = 8;
constexpr bool kWide = false;
#endif
// rows per pass over the weights, and panels per parallel work item (AVX2: 4 x K x 8 floats)
constexpr int kMaxChunk[2] = {kLanes == 16 ? 16 : 8, kLanes == 16 ? 12 : 8};  // [narrow, wide]
constexpr int64_t kStrip[2] = {4, kLanes == 16 ? 2 : 4};
#if defined(__AVX512F__)
constexpr int64_t kPrefetch = 128;  // vectors ahead in the panel (measured: 64 was 14-20% slower)
#else
constexpr int64_t kPrefetch = 64;  // the AVX2 shape as tuned on a Zen 3 (not re-measured there)
#endif
// Prefetched into L2 (prefetcht1), not as non-temporal (prefetchnta): on a Xeon (Sapphire Rapids class,
// KVM) NTA prefetches made the kernel 3x slower than with no prefetch at all (the default model's
// linears at 1 row: 57 ms NTA, 19 no prefetch, 17.6 L2; F.linear 21 ms; 2026-11-25, 2 threads).
// Not re-measured on the AMD machines the distances above were tuned on.
constexpr int kLocality = 2;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

inline void store(float* p, vec v, int n) {
  if (n == kLanes) {
    std::memcpy(p, &v, sizeof(vec));
  } else {
    for (int i = 0; i < n; ++i) p[i] = v[i];
  }
}

// Panels side by side for a chunk of M rows: R * M accumulators stay in registers.
// AVX-512 narrow: one panel, its weights prefetched kPrefetch vectors (8 KB) ahead, streamed at memory
// speed for every M on a Zen 4: the linears of the default model (30 layers + lm_head, cold, 2
// threads) took 14.3-14.8 ms for 1-8 rows and 21.1 ms for 16, where 2-4 panels with 4 KB prefetch took
// 15.8-17.5 and 24.7 ms (MKL's W @ x^T: 14.4-15.8 ms for 1-4 rows, 30.4 for 8). Wide: see the top.
template <int M, bool Wide>
constexpr int panels_at_once() {
#if defined(__AVX512F__)
  return Wide && M >= 3 ? 2 : 1;
#else
  return M <= 3 ? 4 : M <= 4 ? 3 : M <= 6 ? 2 : 1;
#endif
}

// Panels [p0, p1) against M rows of x (M accumulators x R panels). wp: [P, K, L]; y: [M, N] rows.
template <int M, int R>
void chunk(const float* x, const float* wp, float* y, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + R <= p1; p += R) {
    vec acc[R][M];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[r][m] = vec{};
    const float* w = wp + p * K * kLanes;
    for (int64_t k = 0; k < K; ++k) {
      vec wr[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __builtin_prefetch(w + (r * K + k + kPrefetch) * kLanes, 0, kLocality);
        wr[r] = load(w + (r * K + k) * kLanes);
      }
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const float xs = x[m * K + k];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][m] += wr[r] * xs;
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t n0 = (p + r) * kLanes;
      const int n = static_cast<int>(std::min<int64_t>(kLanes, N - n0));
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) store(y + m * N + n0, acc[r][m], n);
    }
  }
  if (p < p1) chunk<M, 1>(x, wp, y, K, N, p, p1);
}

using ChunkFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
template <bool Wide, int... Ms>
ChunkFn pick(int m, std::integer_sequence<int, Ms...>) {
  static constexpr ChunkFn fns[] = {chunk<Ms + 1, panels_at_once<Ms + 1, Wide>()>...};
  return fns[m - 1];
}

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: a float32 [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kLanes - 1) / kLanes;
  at::Tensor padded = at::zeros({P * kLanes, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kLanes, K}).transpose(1, 2).contiguous();  // [P, K, L]
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, bool wide) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == kLanes, "linear: x [M, K], packed w [P, K, ", kLanes, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat, "linear: float32 only");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(wp.size(1) == K, "linear: x has ", K, " features, the packed weight ", wp.size(1));
  TORCH_CHECK(1 <= M && M <= 16, "linear: 1 to 16 rows, got ", M);
  TORCH_CHECK(wp.size(0) * kLanes >= N && N > (wp.size(0) - 1) * kLanes, "linear: N does not fit the packing");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int shape = wide && kWide ? 1 : 0;
  const int64_t P = wp.size(0), strip = kStrip[shape], strips = (P + strip - 1) / strip;
  const int chunks = static_cast<int>((M + kMaxChunk[shape] - 1) / kMaxChunk[shape]);
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t p0 = s * strip, p1 = std::min(P, p0 + strip);
      int64_t m0 = 0;
      for (int c = 0; c < chunks; ++c) {  // balanced chunks: 12 rows on AVX2 -> 6 + 6, 16 -> 8 + 8
        const int mc = static_cast<int>((M - m0) / (chunks - c));
        const ChunkFn fn = shape ? pick<kWide>(mc, std::make_integer_sequence<int, kMaxChunk[1]>{})
                                 : pick<false>(mc, std::make_integer_sequence<int, kMaxChunk[0]>{});
        fn(xp + m0 * K, w, yp + m0 * N, K, N, p0, p1);
        m0 += mc;
      }
    }
  });
  return y;
}

int64_t lanes() { return kLanes; }

bool has_wide() { return kWide; }

// Whether at::parallel_for runs on torch's thread pool here: it is inlined, and without -fopenmp it
// runs every strip on the calling thread (the kernel then streamed at one core's bandwidth).
bool parallel() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace

SPECDEC_LIBRARY(SPECDEC_OPS, m) {
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor wp, int n, bool wide=False) -> Tensor");
  m.def("lanes() -> int", &lanes);  // L: the packing's panel width, for tests and bench-verify
  m.def("parallel() -> bool", &parallel);
  m.def("has_wide() -> bool", &has_wide);  // whether ``wide`` picks another shape (AVX-512 builds)
}
SPECDEC_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
