// A prompt's causal attention over itself in bf16 products (AVX512-BF16): the prefill of a target in int8
// numerics (docs/decisions/019-int8-numerics.md). q, k, v are rounded to bf16 (round to nearest even; a store's
// bf16 K/V are taken as held), q.k and p.v are vdpbf16ps dot products accumulated in fp32, the softmax in fp32
// (vec.h's vexp), p rounded to bf16.
// Position i's rows (the grouped heads that share its KV head) attend keys 0..i in blocks of 32 keys from key 0,
// online softmax (running max and sum, rescaled only when the max grows, which leaves the same bits as
// rescaling by 1): a row's output depends only on its query and keys 0..i, never on the prompt's length, the
// other rows or the thread count. Threads split positions (paired first with last, for even work), never a
// row's keys. Builds without AVX512-BF16 leave the op refusing (``prompt_attention_supports`` false).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "ops.h"
#include "vec.h"

namespace {

constexpr int64_t kBlock = 32;  // keys per block: two vectors of scores (one max and sum per 32 keys)

#if defined(__AVX512BF16__) && defined(__AVX512F__)

inline uint16_t to_bf16(float f) { return specdec_vec::bf16_of(f); }  // round to nearest even

inline uint16_t to_bf16(uint16_t b) { return b; }  // a store's bf16 K/V (int8 numerics): as held

// x[0], x[1] as one 32-bit word of two bf16 (x[0] in the low half): vdpbf16ps's pair
template <typename T>
inline uint32_t bf16_pair(const T* x) {
  return static_cast<uint32_t>(to_bf16(x[0])) | (static_cast<uint32_t>(to_bf16(x[1])) << 16);
}

// keys [L, D] (row stride ks; fp32, or a store's bf16) -> [blocks][D / 2 words][32 keys] 32-bit words: word p
// of key j holds its bf16 dims 2p, 2p + 1; keys past L are zeros (their scores are masked)
template <typename T>
void pack_keys(const T* k, int64_t ks, int64_t L, int64_t D, uint32_t* out) {
  const int64_t blocks = (L + kBlock - 1) / kBlock, W = D / 2;
  std::memset(out, 0, blocks * W * kBlock * sizeof(uint32_t));
  for (int64_t j = 0; j < L; ++j) {
    const T* row = k + j * ks;
    uint32_t* dst = out + (j / kBlock) * W * kBlock + (j % kBlock);
    for (int64_t p = 0; p < W; ++p) dst[p * kBlock] = bf16_pair(row + 2 * p);
  }
}

// values [L, D] (row stride vs; fp32 or bf16) -> [blocks][16 key pairs][D] 32-bit words: word d of pair c holds
// the bf16 of dim d of keys 2c, 2c + 1 of the block (zeros past L)
template <typename T>
void pack_values(const T* v, int64_t vs, int64_t L, int64_t D, uint32_t* out) {
  const int64_t blocks = (L + kBlock - 1) / kBlock;
  std::memset(out, 0, blocks * (kBlock / 2) * D * sizeof(uint32_t));
  for (int64_t j = 0; j < L; ++j) {
    const T* row = v + j * vs;
    uint32_t* dst = out + (j / kBlock) * (kBlock / 2) * D + ((j % kBlock) / 2) * D;
    const int shift = (j % 2) * 16;
    for (int64_t d = 0; d < D; ++d) dst[d] |= static_cast<uint32_t>(to_bf16(row[d])) << shift;
  }
}

// R rows at position i (queries q[r], outputs out[r]; scale applied to the fp32 scores) over keys 0..i
template <int D, int R>
void position(const float* const* q, float scale, int64_t i, const uint32_t* kp, const uint32_t* vp,
              float* const* out) {
  using specdec_vec::vexp;
  using specdec_vec::vec;
  constexpr int W = D / 2, V = D / 16;
  uint32_t qw[R][W];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < W; ++p) qw[r][p] = bf16_pair(q[r] + 2 * p);
  __m512 acc[R][V];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    for (int t = 0; t < V; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t last = i / kBlock;
  for (int64_t kb = 0; kb <= last; ++kb) {
    const uint32_t* kblk = kp + kb * W * kBlock;
    __m512 s0[R], s1[R];  // keys 0-15 and 16-31 of the block
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
    for (int p = 0; p < W; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kblk + p * kBlock);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kblk + p * kBlock + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(qw[r][p]);
        s0[r] = _mm512_dpbf16_ps(s0[r], qb, k0);
        s1[r] = _mm512_dpbf16_ps(s1[r], qb, k1);
      }
    }
    const int64_t seen_n = kb < last ? kBlock : i - kb * kBlock + 1;  // keys 0..i of this block
    const __mmask16 seen0 = seen_n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << seen_n) - 1u);
    const __mmask16 seen1 = seen_n >= 32 ? __mmask16(0xFFFF) : seen_n <= 16 ? __mmask16(0) : __mmask16((1u << (seen_n - 16)) - 1u);
    alignas(64) uint32_t pw[R][kBlock / 2];
    for (int r = 0; r < R; ++r) {
      s0[r] = _mm512_mask_mov_ps(ninf, seen0, _mm512_mul_ps(s0[r], vscale));
      s1[r] = _mm512_mask_mov_ps(ninf, seen1, _mm512_mul_ps(s1[r], vscale));
      const float mb = _mm512_reduce_max_ps(_mm512_max_ps(s0[r], s1[r]));
      if (mb > m[r]) {  // the running max grows: rescale what came before (e^-inf = 0 at the first block)
        const float alpha = vexp(specdec_vec::splat(m[r] - mb))[0];
        l[r] *= alpha;
        const __m512 va = _mm512_set1_ps(alpha);
        for (int t = 0; t < V; ++t) acc[r][t] = _mm512_mul_ps(acc[r][t], va);
        m[r] = mb;
      }
      const __m512 mv = _mm512_set1_ps(m[r]);
      const __m512 p0 = reinterpret_cast<__m512>(vexp(reinterpret_cast<vec>(_mm512_sub_ps(s0[r], mv))));
      const __m512 p1 = reinterpret_cast<__m512>(vexp(reinterpret_cast<vec>(_mm512_sub_ps(s1[r], mv))));
      l[r] += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      _mm512_store_si512(pw[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // bf16 of keys 0..31, in order
    }
    const uint32_t* vblk = vp + kb * (kBlock / 2) * D;
    for (int c = 0; c < kBlock / 2; ++c) {
      for (int t = 0; t < V; ++t) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vblk + c * D + 16 * t);
        for (int r = 0; r < R; ++r)
          acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)_mm512_set1_epi32(pw[r][c]), vv);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int t = 0; t < V; ++t) _mm512_storeu_ps(out[r] + 16 * t, _mm512_mul_ps(acc[r][t], inv));
  }
}

template <int D>
void rows_of_position(const float* const* q, int n, float scale, int64_t i, const uint32_t* kp, const uint32_t* vp,
                      float* const* out) {
  constexpr int kMax = D == 64 ? 4 : 2;  // rows at a time: their accumulators stay in registers
  for (int r0 = 0; r0 < n; r0 += kMax) {
    switch (std::min(kMax, n - r0)) {
      case 1: position<D, 1>(q + r0, scale, i, kp, vp, out + r0); break;
      case 2: position<D, 2>(q + r0, scale, i, kp, vp, out + r0); break;
      case 3: if constexpr (kMax >= 3) position<D, 3>(q + r0, scale, i, kp, vp, out + r0); break;
      default: if constexpr (kMax >= 4) position<D, 4>(q + r0, scale, i, kp, vp, out + r0); break;
    }
  }
}

constexpr bool kBuilt = true;
#else
constexpr bool kBuilt = false;
#endif

bool prompt_attention_supports(int64_t D) { return kBuilt && (D == 64 || D == 128); }

// query [B, H, n * Q, D] (row r * Q + i: grouped head r's query at position past + i), key / value
// [B, H, past + Q, D] (the rows before the block, then the block's own; rows contiguous), causal: the query at
// position p sees keys 0..p -> [B, H, n * Q, D]. A row's output is the same for any past (the keys before it
// are the same keys): a prompt prefilled in pieces gets the bits of one piece.
at::Tensor prompt_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale,
                            int64_t past) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "prompt_attention: 4-d query, key, value");
  TORCH_CHECK(query.scalar_type() == at::kFloat && value.scalar_type() == key.scalar_type() &&
                  (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16),
              "prompt_attention: a float32 query; key and value both float32 or both bfloat16 (a store's)");
  const int64_t B = query.size(0), H = query.size(1), R = query.size(2), D = query.size(3), L = key.size(2);
  const int64_t Q = L - past;
  TORCH_CHECK(key.size(0) == B && key.size(1) == H && key.size(3) == D && value.sizes() == key.sizes(),
              "prompt_attention: key / value [B, H, past + Q, D] matching the query");
  TORCH_CHECK(past >= 0 && Q > 0 && R % Q == 0, "prompt_attention: query rows a multiple of the block's length");
  TORCH_CHECK(prompt_attention_supports(D), "prompt_attention: this build has no AVX512-BF16 shape for head size ", D);
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "prompt_attention: key / value rows contiguous");
  const at::Tensor qc = query.contiguous();
  at::Tensor out = at::empty({B, H, R, D}, query.options());
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const int64_t n = R / Q, blocks = (L + kBlock - 1) / kBlock;
  at::Tensor kpk = at::empty({B * H, blocks * kBlock * D / 2}, key.options().dtype(at::kInt));
  at::Tensor vpk = at::empty({B * H, blocks * kBlock * D / 2}, key.options().dtype(at::kInt));
  uint32_t* kp = reinterpret_cast<uint32_t*>(kpk.data_ptr<int32_t>());
  uint32_t* vp = reinterpret_cast<uint32_t*>(vpk.data_ptr<int32_t>());
  const int64_t per = blocks * kBlock * D / 2;
  at::parallel_for(0, B * H, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t b = a / H, h = a % H;
      const int64_t ko = b * key.stride(0) + h * key.stride(1), vo = b * value.stride(0) + h * value.stride(1);
      if (key.scalar_type() == at::kBFloat16) {  // bf16 as held: the rounding below would leave it as it is
        pack_keys(reinterpret_cast<const uint16_t*>(key.data_ptr()) + ko, key.stride(2), L, D, kp + a * per);
        pack_values(reinterpret_cast<const uint16_t*>(value.data_ptr()) + vo, value.stride(2), L, D, vp + a * per);
      } else {
        pack_keys(key.data_ptr<float>() + ko, key.stride(2), L, D, kp + a * per);
        pack_values(value.data_ptr<float>() + vo, value.stride(2), L, D, vp + a * per);
      }
    }
  });
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t pairs = (Q + 1) / 2;  // item t: positions t and Q - 1 - t (even work per item)
  at::parallel_for(0, B * H * pairs, 1, [&](int64_t t0, int64_t t1) {
    const float* qrows[8];
    float* orows[8];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t a = t / pairs, pair = t % pairs, b = a / H, h = a % H;
      for (const int64_t i : {pair, Q - 1 - pair}) {
        for (int64_t r0 = 0; r0 < n; r0 += 8) {
          const int rows = static_cast<int>(std::min<int64_t>(8, n - r0));
          for (int r = 0; r < rows; ++r) {
            const int64_t row = ((b * H + h) * R) + (r0 + r) * Q + i;
            qrows[r] = qp + row * D;
            orows[r] = op + row * D;
          }
          if (D == 64)
            rows_of_position<64>(qrows, rows, static_cast<float>(scale), past + i, kp + a * per, vp + a * per, orows);
          else
            rows_of_position<128>(qrows, rows, static_cast<float>(scale), past + i, kp + a * per, vp + a * per, orows);
        }
        if (Q - 1 - pair == pair) break;  // the middle position of an odd prompt: once
      }
    }
  });
#endif
  return out;
}

}  // namespace

SPECDEC_FRAGMENT(SPECDEC_OPS, m) {
  m.def("prompt_attention(Tensor query, Tensor key, Tensor value, float scale, int past=0) -> Tensor");
  m.def("prompt_attention_supports(int d) -> bool", &prompt_attention_supports);
}
SPECDEC_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) { m.impl("prompt_attention", &prompt_attention); }
