// y = x @ w^T for 4-16 rows of x (verify blocks), from weights packed in panels of 16 output rows.
//
// A verify step multiplies a few rows by every weight matrix of the model, so it should cost what
// streaming the weights from memory costs. MKL's GEMM does not stream them at that rate for 4-16
// rows (see specdec/kernels.py), so this kernel does: the weight is packed once into panels
// [P, K, 16] (16 output features side by side for each input feature), so the inner loop reads
// one vector of weights per input feature and multiplies it with a broadcast of each row's input,
// M accumulators per panel in registers, no horizontal sums; 2-4 panels at a time share each
// broadcast. The vectors are GCC vector extensions (AVX-512, AVX2 or SSE, as the compiler targets);
// threads are torch's own pool (at::parallel_for over panels). Built on first use by
// torch.utils.cpp_extension (specdec/kernels.py), with a fallback to torch when no compiler is there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace {

constexpr int kLanes = 16;  // one panel: 16 output features, one vector per input feature
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

// Panels [p0, p1) against all M rows of x (M accumulators x R panels). wp: [P, K, 16]; y: [M, N].
template <int M, int R>
void panels(const float* x, const float* wp, float* y, int64_t K, int64_t N, int64_t p0, int64_t p1) {
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
        __builtin_prefetch(w + (r * K + k + 64) * kLanes, 0, 0);  // 4 KB ahead in the panel
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
  if (p < p1) panels<M, 1>(x, wp, y, K, N, p, p1);
}

template <int M>
void run(const float* x, const float* wp, float* y, int64_t K, int64_t N) {
  constexpr int R = M <= 4 ? 4 : M <= 12 ? 2 : 1;  // R * M accumulators fit the 32 vector registers
  const int64_t P = (N + kLanes - 1) / kLanes;
  const int64_t blocks = (P + R - 1) / R;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    panels<M, R>(x, wp, y, K, N, b0 * R, std::min<int64_t>(b1 * R, P));
  });
}

using Fn = void (*)(const float*, const float*, float*, int64_t, int64_t);
template <int... Ms>
Fn pick(int m, std::integer_sequence<int, Ms...>) {
  static constexpr Fn fns[] = {run<Ms + 1>...};
  return fns[m - 1];
}

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: a float32 [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kLanes - 1) / kLanes;
  at::Tensor padded = at::zeros({P * kLanes, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kLanes, K}).transpose(1, 2).contiguous();  // [P, K, 16]
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == kLanes, "linear: x [M, K], packed w [P, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat, "linear: float32 only");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(wp.size(1) == K, "linear: x has ", K, " features, the packed weight ", wp.size(1));
  TORCH_CHECK(1 <= M && M <= 16, "linear: 1 to 16 rows, got ", M);
  TORCH_CHECK(wp.size(0) * kLanes >= N && N > (wp.size(0) - 1) * kLanes, "linear: N does not fit the packing");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  pick(static_cast<int>(M), std::make_integer_sequence<int, 16>{})(
      xc.data_ptr<float>(), wp.data_ptr<float>(), y.data_ptr<float>(), K, N);
  return y;
}

}  // namespace

TORCH_LIBRARY(specdec_kernels, m) {
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor wp, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec_kernels, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
