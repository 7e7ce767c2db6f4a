// What this CPU's vector units can do at most, for decision 019's bound on a verify's products: multiply-adds a
// second of (1) 512-bit and 256-bit VNNI alone (vpdpbusd, 12 independent chains), (2) 512-bit fp32 FMA alone, and
// (3) the int8 kernel's own mix per row and 32-weight block of 16 features (int8_linear.cpp's rows_step for Q4_1:
// 8 vpdpbusd on broadcast codes, one convert, one product, two FMAs), 8 rows at a time, codes in registers: the
// kernel with every load from L1 and nothing else to do. Built by scripts/kernel_ceilings.py (--parts peak):
//     c++ -O2 -march=native -pthread scripts/cpu_peak.cpp -o cpu_peak && ./cpu_peak THREADS
// Prints one line per test: "name GMAC/s" over all threads (each thread runs its own copy).
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

constexpr long kIters = 40000000;

#define KEEP(x) __asm__ volatile("" : "+v"(x))

// 12 independent chains of op(acc, x, w) kIters deep (enough to hide any op's latency); returns the
// multiply-adds done, macs a call
template <typename V, typename Op>
double chains(V x, V w, Op op, double macs) {
  V a0 = x, a1 = w, a2 = x, a3 = w, a4 = x, a5 = w, a6 = x, a7 = w, a8 = x, a9 = w, a10 = x, a11 = w;
  for (long i = 0; i < kIters; ++i) {
    a0 = op(a0, x, w); a1 = op(a1, x, w); a2 = op(a2, x, w); a3 = op(a3, x, w); a4 = op(a4, x, w);
    a5 = op(a5, x, w); a6 = op(a6, x, w); a7 = op(a7, x, w); a8 = op(a8, x, w); a9 = op(a9, x, w);
    a10 = op(a10, x, w); a11 = op(a11, x, w);
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5); KEEP(a6); KEEP(a7); KEEP(a8); KEEP(a9); KEEP(a10); KEEP(a11);
  }
  return 12.0 * macs * kIters;
}

double vnni512() {
  return chains(_mm512_set1_epi8(3), _mm512_set1_epi8(5),
                [](__m512i a, __m512i x, __m512i w) { return _mm512_dpbusd_epi32(a, x, w); }, 64);
}

double vnni256() {
  return chains(_mm256_set1_epi8(3), _mm256_set1_epi8(5),
                [](__m256i a, __m256i x, __m256i w) { return _mm256_dpbusd_epi32(a, x, w); }, 32);
}

double fma512() {  // fp32 multiply-adds
  return chains(_mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f),
                [](__m512 a, __m512 x, __m512 w) { return _mm512_fmadd_ps(a, x, w); }, 16);
}

// the kernel's mix: per block, for each of 8 rows, 8 vpdpbusd (the row's codes broadcast from L1), then
// acc = fma(float(dot), D * dx, acc) and off = fma(M, sx, off); 512 multiply-adds a row and block
double kernel_mix() {
  constexpr int R = 8;
  alignas(64) int32_t codes[R * 8];
  alignas(64) float dx[R], sx[R];
  for (int i = 0; i < R * 8; ++i) codes[i] = 0x01020304 + i;
  for (int r = 0; r < R; ++r) dx[r] = 1e-3f * (r + 1), sx[r] = 2e-3f * (r + 1);
  __m512i c0 = _mm512_set1_epi8(1), c1 = _mm512_set1_epi8(2), c2 = _mm512_set1_epi8(3), c3 = _mm512_set1_epi8(4);
  __m512i c4 = _mm512_set1_epi8(5), c5 = _mm512_set1_epi8(6), c6 = _mm512_set1_epi8(7), c7 = _mm512_set1_epi8(8);
  __m512 d = _mm512_set1_ps(1e-4f), m = _mm512_set1_ps(-1e-4f);
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), off[r] = _mm512_setzero_ps();
  const long blocks = kIters / 8;
  for (long i = 0; i < blocks; ++i) {
    KEEP(c0); KEEP(c1); KEEP(c2); KEEP(c3); KEEP(c4); KEEP(c5); KEEP(c6); KEEP(c7); KEEP(d); KEEP(m);
    const int32_t* xq = codes;
    const float *xd = dx, *xs = sx;
    __asm__("" : "+r"(xq), "+r"(xd), "+r"(xs));  // unknown to the compiler: each block reads the rows again, as the kernel does
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int32_t* x = xq + 8 * r;
      __m512i s = _mm512_setzero_si512();
      s = _mm512_dpbusd_epi32(s, c0, _mm512_set1_epi32(x[0])); s = _mm512_dpbusd_epi32(s, c1, _mm512_set1_epi32(x[1]));
      s = _mm512_dpbusd_epi32(s, c2, _mm512_set1_epi32(x[2])); s = _mm512_dpbusd_epi32(s, c3, _mm512_set1_epi32(x[3]));
      s = _mm512_dpbusd_epi32(s, c4, _mm512_set1_epi32(x[4])); s = _mm512_dpbusd_epi32(s, c5, _mm512_set1_epi32(x[5]));
      s = _mm512_dpbusd_epi32(s, c6, _mm512_set1_epi32(x[6])); s = _mm512_dpbusd_epi32(s, c7, _mm512_set1_epi32(x[7]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xd[r])), acc[r]);
      off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r]), off[r]);
    }
  }
  float sink = 0.f;
  for (int r = 0; r < R; ++r) sink += _mm512_reduce_add_ps(_mm512_add_ps(acc[r], off[r]));
  if (sink == 12345.f) std::puts("");  // keeps the sums live
  return 512.0 * R * blocks;
}

void run(const char* name, double (*fn)(), int threads) {
  std::vector<std::thread> pool;
  std::vector<double> macs(threads);
  const auto t = std::chrono::steady_clock::now();
  for (int i = 0; i < threads; ++i) pool.emplace_back([&, i] { macs[i] = fn(); });
  for (auto& p : pool) p.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  double total = 0;
  for (double v : macs) total += v;
  std::printf("%s %.1f\n", name, total / s / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  run("vnni512", vnni512, threads);
  run("vnni256", vnni256, threads);
  run("fma512", fma512, threads);
  run("kernel_mix", kernel_mix, threads);
  return 0;
}
