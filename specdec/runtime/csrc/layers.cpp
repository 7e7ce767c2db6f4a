// Every decoder layer of a decode or verify block in one call: the lean forward's loop, without Python.
//
// A 1-row step of the default model (30 layers) made ~10 Python-level calls a layer between its four
// linears: the fused ops, the K/V store's write, views, the attention kernel. Each call costs a few
// microseconds of interpreter and dispatch, more in place (the weight stream has just pushed their code
// and data out of the caches), and each gap leaves the memory system idle before the next linear starts
// streaming its weights. ``layers`` runs the same ops in the same order for every layer of a block:
//   h = the first layer's input norm (the caller's); for each layer i:
//     q, k, v = rope_split(linear(h, qkv_i));  k, v written at rows starts[b] .. starts[b] + Q of the
//     store's buffers (fp32, or bf16 in int8 numerics) as BMCLayer.update writes them;
//     o = attention(q, k_view, v_view, mask) over the first ``end`` rows, or with ``split`` per batch row
//     over its own start + Q rows (SPLIT attention);
//     each by the kernel or, where the self-check found SDPA faster, SDPA over the grouped query rows
//     as runtime/attention.py grouped_attention calls it;  x, h = add_rms_norm(x, linear(o, o_i), norm2_i);
//     x, h = add_rms_norm(x, linear(silu_mul(linear(h, gate_up_i)), down_i), next_norm_i)
// and returns (x, h, the inputs of the ``keep`` layers concatenated: EAGLE-3's features). The ops are this build's own (the dispatcher's handles, found once), the linears
// by the routes the caller planned: per chunk of rows, F.linear (0), W @ x^T (1: an odd row count padded
// with a zero row, as runtime/linear.py _skinny), the packed kernel (2) or its wide shape (3); or, for a
// quantized target (``quant`` given), every linear by the block kernel (csrc/quant_linear.cpp) over its
// parts' blocks side by side (q, k, v; gate, up), outputs concatenated as lean_layer.py's Stacked does, or
// with ``approx`` (a draft's forward of one or two rows, runtime/int8_linear.py's draft route) by the int8
// draft kernel (csrc/int8_linear.cpp). Same ops, same order, same arguments as specdec/fastpath.py's
// loop (its arguments made by specdec/one_call.py): the results are the loop's, bit for bit.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers only
#include <ATen/core/Tensor.h>  // the Tensor, its methods, and each op used from its own header
                                // (ATen.h declares every op: docs/decisions/015-quant-kernels.md)
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"
#include "vec.h"

#define SPECDEC_STR2(x) #x
#define SPECDEC_STR(x) SPECDEC_STR2(x)

namespace {

using at::Tensor;
using Pair = std::tuple<Tensor, Tensor>;
using Triple = std::tuple<Tensor, Tensor, Tensor>;

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((std::string(SPECDEC_STR(SPECDEC_OPS)) + "::" + name).c_str(), "");
}

struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, bool)> linear;
  c10::TypedOperatorHandle<Triple(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)> rope_split;
  c10::TypedOperatorHandle<Pair(const Tensor&, const Tensor&, const Tensor&, double)> add_rms_norm;
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, double)>
      attention;
  c10::TypedOperatorHandle<Tensor(const Tensor&, at::TensorList, at::IntArrayRef)> quant_linear_parts;
  c10::TypedOperatorHandle<Tensor(const Tensor&, at::TensorList, at::IntArrayRef)> quant_linear_i8;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, double)>
      row_attention;
};

const Ops& ops() {
  static const Ops o{
      op("linear").typed<Tensor(const Tensor&, const Tensor&, int64_t, bool)>(),
      op("rope_split").typed<Triple(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)>(),
      op("add_rms_norm").typed<Pair(const Tensor&, const Tensor&, const Tensor&, double)>(),
      op("silu_mul").typed<Tensor(const Tensor&)>(),
      op("attention").typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, double)>(),
      op("quant_linear_parts").typed<Tensor(const Tensor&, at::TensorList, at::IntArrayRef)>(),
      op("quant_linear_i8").typed<Tensor(const Tensor&, at::TensorList, at::IntArrayRef)>(),
      op("row_attention").typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, double)>(),
  };
  return o;
}

// the rows [b0, b1) of a batch that attend together over their first ``keys`` rows of the store, by the
// kernel or by SDPA, under ``mask`` (cut to those keys; for SDPA repeated for the grouped rows)
struct Group {
  int64_t b0, b1, keys;
  bool kernel;
  std::optional<Tensor> mask;
};

enum Route : int64_t { kLinear = 0, kMm = 1, kPacked = 2, kWide = 3 };

// n floats into a store's bf16 buffer (int8 numerics' store), rounded as BMCLayer.update's write rounds them
void to_bf16(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = specdec_vec::bf16_of(src[i]);
}

// A quantized target's linears: per linear, its parts' blocks (uint8 [N_p, row_bytes]) and GGML types
struct QuantParts {
  std::vector<int64_t> first, count, types;  // per linear: its first part's index in ``blocks``, its part count
  std::vector<Tensor> blocks;
};

// ``quant``: per linear, its part count then each part's GGML type; ``blocks``: every part's blocks in order
QuantParts quant_parts(at::IntArrayRef quant, at::TensorList blocks, int64_t linears) {
  QuantParts q;
  size_t at = 0, part = 0;
  for (int64_t l = 0; l < linears; ++l) {
    TORCH_CHECK(at < quant.size() && quant[at] >= 1, "layers: quant lists no parts for linear ", l);
    const int64_t parts = quant[at++];
    q.first.push_back(static_cast<int64_t>(part));
    q.count.push_back(parts);
    for (int64_t p = 0; p < parts; ++p, ++part) {
      TORCH_CHECK(at < quant.size() && part < blocks.size(), "layers: quant names more parts than the ",
                  blocks.size(), " blocks given");
      q.types.push_back(quant[at++]);
      q.blocks.push_back(blocks[part]);
    }
  }
  TORCH_CHECK(at == quant.size() && part == blocks.size(), "layers: ", blocks.size(), " blocks and ", quant.size(),
              " quant entries for ", linears, " linears do not match");
  return q;
}

// x [..., K] through linear l's parts by the block kernel in one call, outputs side by side -> [..., sum of N_p];
// with ``approx``, by the int8 draft kernel (csrc/int8_linear.cpp: a draft's forward, never a verify)
Tensor quant_linear(const Tensor& x, const QuantParts& q, int64_t l, bool approx) {
  const int64_t K = x.size(-1), rows = x.numel() / K;
  const auto parts = at::TensorList(q.blocks).slice(q.first[l], q.count[l]);
  const auto types = at::IntArrayRef(q.types).slice(q.first[l], q.count[l]);
  const auto& route = approx ? ops().quant_linear_i8 : ops().quant_linear_parts;
  Tensor y = route.call(x.reshape({rows, K}), parts, types);
  auto sizes = x.sizes().vec();
  sizes.back() = y.size(1);
  return y.view(sizes);
}

// kernels.linear over x [..., K] by the planned chunks: plan = [start, end, route] per chunk of rows
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& packed, const std::optional<Tensor>& bias,
              const std::vector<int64_t>& plan) {
  const int64_t K = x.size(-1), rows = x.numel() / K, N = w.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  if (plan.size() == 3 && plan[2] == kLinear) return at::linear(x, w, bias);
  if (plan.size() == 3 && plan[2] >= kPacked && !bias.has_value())  // the common case: one kernel block
    return ops().linear.call(x.view({rows, K}), packed, N, plan[2] == kWide).view(out_sizes);
  const Tensor x2 = x.reshape({rows, K});
  std::vector<Tensor> parts;
  for (size_t c = 0; c < plan.size(); c += 3) {
    const Tensor xc = x2.slice(0, plan[c], plan[c + 1]);
    const int64_t m = plan[c + 1] - plan[c];
    if (plan[c + 2] == kMm) {
      const Tensor xp = m % 2 ? at::cat({xc, at::zeros({1, K}, xc.options())}) : xc;
      parts.push_back(at::mm(w, xp.t()).t().slice(0, 0, m));
    } else {
      parts.push_back(ops().linear.call(xc, packed, N, plan[c + 2] == kWide));
    }
  }
  Tensor y = parts.size() == 1 ? parts[0] : at::cat(parts);
  if (bias.has_value()) y = y + *bias;
  return y.contiguous().view(out_sizes);
}

Triple layers(const Tensor& x0, const Tensor& h0, at::TensorList weights, at::TensorList packed,
            const c10::List<std::optional<Tensor>>& biases, at::TensorList norms, at::ArrayRef<double> eps,
            at::TensorList keys, at::TensorList values, at::IntArrayRef starts, const Tensor& cos, const Tensor& sin,
            const std::optional<Tensor>& mask, int64_t hq, int64_t hkv, double scale, at::IntArrayRef plan,
            c10::List<bool> kernel_attention, bool split, at::IntArrayRef quant, at::IntArrayRef keep, bool approx,
            bool rows) {
  // rows: a target in int8 numerics (specdec/quant/numerics.py): every linear by the int8 kernel, every
  // attention a row at a time (csrc/row_attention.cpp), as the Python loop runs them in that numerics
  const int64_t n = static_cast<int64_t>(keys.size());
  const bool quantized = !quant.empty();  // weights and biases then empty, packed the parts' blocks
  const QuantParts qparts = quantized ? quant_parts(quant, packed, 4 * n) : QuantParts{};
  TORCH_CHECK(!(approx || rows) || quantized, "layers: approx and rows are for a quantized target's linears");
  TORCH_CHECK(x0.dim() == 3 && h0.sizes() == x0.sizes(), "layers: x and h [B, Q, C]");
  TORCH_CHECK(values.size() == keys.size() && (quantized || weights.size() == static_cast<size_t>(4 * n)) &&
                  biases.size() == weights.size() && norms.size() == static_cast<size_t>(2 * n) &&
                  eps.size() == norms.size(),
              "layers: per layer 4 weights and biases, 2 norms with their eps, keys and values; got ",
              weights.size(), " weights, ", biases.size(), " biases, ", norms.size(), " norms, ", eps.size(),
              " eps, ", keys.size(), " keys and ", values.size(), " values");
  const std::vector<int64_t> chunks(plan.begin(), plan.end());
  TORCH_CHECK(!chunks.empty() && chunks.size() % 3 == 0, "layers: a plan of [start, end, route] chunks");
  bool kernel = false;
  for (size_t c = 2; c < chunks.size(); c += 3) {
    TORCH_CHECK(chunks[c] >= kLinear && chunks[c] <= kWide, "layers: route ", chunks[c], " is not 0-3");
    kernel = kernel || chunks[c] >= kPacked;
  }
  TORCH_CHECK(quantized || !kernel || packed.size() == weights.size(), "layers: the plan runs the kernel, ", packed.size(),
              " packed weights for ", weights.size());
  const int64_t B = x0.size(0), Q = x0.size(1);
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == B, "layers: ", starts.size(), " starts for a batch of ", B);
  int64_t end = 0;
  for (int64_t s : starts) end = std::max(end, s + Q);
  // who attends over which keys: PAD, every row over the first ``end`` rows in one call; SPLIT, each
  // batch row alone over its own rows (runtime/attention.py split_attention). Each by the kernel or by SDPA.
  const int64_t groups = split ? B : 1;
  TORCH_CHECK(static_cast<int64_t>(kernel_attention.size()) == groups, "layers: ", kernel_attention.size(),
              " attention routes for ", groups, split ? " rows (SPLIT)" : " block (PAD)");
  std::vector<Group> parts;
  for (int64_t g = 0; g < groups; ++g) {
    Group p{split ? g : 0, split ? g + 1 : B, split ? starts[g] + Q : end, kernel_attention.get(g), std::nullopt};
    if (mask.has_value()) p.mask = (split ? mask->slice(0, g, g + 1) : *mask).slice(3, 0, p.keys);
    TORCH_CHECK(rows || p.kernel || (p.mask.has_value() && hq > hkv),
                "layers: SDPA's attention here only for grouped heads under a mask (grouped_attention's path)");
    if (!rows && !p.kernel && Q > 1) p.mask = p.mask->repeat({1, 1, hq / hkv, 1});  // SDPA's: a mask row per grouped row
    parts.push_back(std::move(p));
  }
  for (int64_t j : keep) TORCH_CHECK(j >= 0 && j < n, "layers: keep names layer ", j, " of ", n);
  std::vector<Tensor> inputs(keep.size());  // the residual stream entering each kept layer
  Tensor x = x0, h = h0;
  for (int64_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < keep.size(); ++j)
      if (keep[j] == i) inputs[j] = x;  // add_rms_norm returns new tensors: this x stays as it is
    const auto lin = [&](const Tensor& in, int64_t j) {
      const int64_t at = 4 * i + j;
      if (quantized) return quant_linear(in, qparts, at, approx || rows);
      return linear(in, weights[at], kernel ? packed[at] : weights[at], biases.get(at), chunks);
    };
    auto [q, k, v] = ops().rope_split.call(lin(h, 0), cos, sin, hq, hkv);  // q [B, hq, Q, D], k/v [B, hkv, Q, D]
    const Tensor &kb = keys[i], &vb = values[i];
    const int64_t D = q.size(3);
    TORCH_CHECK(kb.dim() == 4 && kb.size(0) == B && kb.size(1) == hkv && kb.size(3) == D && kb.size(2) >= end &&
                    kb.is_contiguous() && vb.sizes() == kb.sizes() && vb.is_contiguous() &&
                    vb.scalar_type() == kb.scalar_type() &&
                    (kb.scalar_type() == at::kFloat || (rows && kb.scalar_type() == at::kBFloat16)),
                "layers: layer ", i, "'s K/V buffers ", kb.sizes(), " do not hold ", end, " rows of [", B, ", ", hkv,
                ", ", D, "] float32 (or bfloat16, attended a row at a time)");
    const bool bf16 = kb.scalar_type() == at::kBFloat16;
    const int64_t C = kb.size(2);
    for (int64_t b = 0; b < B; ++b)  // the store's write: Q rows per (sequence, head) at starts[b]
      for (int64_t j = 0; j < hkv; ++j) {
        const int64_t at = ((b * hkv + j) * C + starts[b]) * D, from = (b * hkv + j) * Q * D;
        if (bf16) {
          to_bf16(reinterpret_cast<uint16_t*>(kb.data_ptr()) + at, k.data_ptr<float>() + from, Q * D);
          to_bf16(reinterpret_cast<uint16_t*>(vb.data_ptr()) + at, v.data_ptr<float>() + from, Q * D);
        } else {
          const size_t bytes = static_cast<size_t>(Q * D) * sizeof(float);
          std::memcpy(kb.data_ptr<float>() + at, k.data_ptr<float>() + from, bytes);
          std::memcpy(vb.data_ptr<float>() + at, v.data_ptr<float>() + from, bytes);
        }
      }
    const Tensor qg = q.view({B, hkv, hq / hkv * Q, D});  // a KV head's query heads as rows of one block
    std::vector<Tensor> outs;
    for (const Group& p : parts) {
      const Tensor qp = groups == 1 ? qg : qg.slice(0, p.b0, p.b1);
      const Tensor kp = (groups == 1 ? kb : kb.slice(0, p.b0, p.b1)).slice(2, 0, p.keys);
      const Tensor vp = (groups == 1 ? vb : vb.slice(0, p.b0, p.b1)).slice(2, 0, p.keys);
      outs.push_back(rows       ? ops().row_attention.call(qp, kp, vp, p.mask, scale)
                     : p.kernel ? ops().attention.call(qp, kp, vp, p.mask, scale)
                                : at::scaled_dot_product_attention(qp, kp, vp, p.mask, 0.0, false, scale));
    }
    Tensor o = outs.size() == 1 ? outs[0] : at::cat(outs);
    o = o.view({B, hq, Q, D}).transpose(1, 2).reshape({B, Q, hq * D});
    std::tie(x, h) = ops().add_rms_norm.call(x, lin(o, 1), norms[2 * i], eps[2 * i]);
    std::tie(x, h) = ops().add_rms_norm.call(x, lin(ops().silu_mul.call(lin(h, 2)), 3), norms[2 * i + 1], eps[2 * i + 1]);
  }
  return {x, h, inputs.empty() ? at::empty({0}, x.options()) : at::cat(inputs, -1)};
}

}  // namespace

SPECDEC_FRAGMENT(SPECDEC_OPS, m) {
  m.def("layers(Tensor x, Tensor h, Tensor[] weights, Tensor[] packed, Tensor?[] biases, Tensor[] norms, "
        "float[] eps, Tensor[] keys, Tensor[] values, int[] starts, Tensor cos, Tensor sin, Tensor? mask, int hq, "
        "int hkv, float scale, int[] plan, bool[] kernel_attention, bool split=False, int[] quant=[], int[] keep=[], bool approx=False, bool rows=False) -> "
        "(Tensor, Tensor, Tensor)");
}
SPECDEC_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) { m.impl("layers", &layers); }
