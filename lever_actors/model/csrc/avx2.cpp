// Weight-only quantized matrix products with AVX2 and FMA, built by model/native.py for CPUs
// without AMX.
//
// Each row of x is first rounded to int8 in groups of 32 inputs (one float32 scale per group,
// as llama.cpp's Q8_0), and a group's products with the 4- or 8-bit weights are summed in
// integers, 32 pairs of bytes per instruction (vpmaddubsw), exactly; the group's sum is then
// scaled in one fixed sequence of float32 operations per output. A row of x takes part in no
// other row's sums, so a row's result is the same alone or as one of 64, and the weights are
// unpacked once per call, however many rows share it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "aten.h"
#include "common.h"
#include "int4.h"
#include "integer_rows.h"
#include "layer.h"
#include "q4k.h"

namespace {

using namespace lever;

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& bias) {
  // x [m, k] bf16; packed [n, k / 2] uint8; scales [k / 32, n, 2] bf16 (scale, zero)
  check_int4(x, packed, scales);
  int64_t rows = x.size(0), k = x.size(1), n = packed.size(0);
  auto out = at::empty({rows, n}, x.options());
  int4_product(u16(x), rows, k, packed.data_ptr<uint8_t>(), reinterpret_cast<const uint32_t*>(scales.data_ptr()), n,
               u16(out));
  return biased(out, bias);
}

// x [m, k] bf16; weight [n, k] int8; scales [n] bf16
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const std::optional<at::Tensor>& bias) {
  check_rows(x);
  check_int8(weight, scales);
  int64_t k = x.size(1), n = weight.size(0);
  TORCH_CHECK(n % ROWS8 == 0 && k % GROUP == 0 && weight.size(1) == k, "int8 shape");
  Int8Rows w{weight.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), k};
  return biased(integer_linear(x, w, n), bias);
}

// a bf16 tensor's elements as uint16 bits, or null for none
const uint16_t* optional_u16(const std::optional<at::Tensor>& t) { return t ? u16(*t) : nullptr; }

// x [n, d] bf16 -> the same after the layer (layer.h). norms: attn_norm, ffn_norm [d] bf16;
// matrices: (data, scales) of each of layer.h's Matrix in order, formats their codes; keys,
// values [L, KV, capacity, hd] bf16 contiguous and slot_positions [capacity] int64: the KV
// cache; offsets [n] int64 or none, positions [n] int64, cos, sin [n, hd] bf16, mask
// [n, length + span] bool or none: the placement
at::Tensor decoder_layer(const at::Tensor& x, at::TensorList norms, at::TensorList matrices, at::IntArrayRef formats,
                         const std::optional<at::Tensor>& bq, const std::optional<at::Tensor>& bk,
                         const std::optional<at::Tensor>& bv, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& slot_positions, int64_t layer, int64_t length, int64_t span,
                         const std::optional<at::Tensor>& offsets, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, const std::optional<at::Tensor>& mask, int64_t n_heads, int64_t hd,
                         double eps, double scale, double softcap) {
  TORCH_CHECK(norms.size() == 2 && matrices.size() == 2 * MATRICES && formats.size() == MATRICES, "decoder_layer: weights");
  check_rows(x);
  for (const at::Tensor* t : {&keys, &values})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kBFloat16 && t->is_contiguous(), "keys, values: [L, KV, capacity, hd] bf16");
  TORCH_CHECK(slot_positions.scalar_type() == at::kLong && slot_positions.is_contiguous(), "slot_positions: int64");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions: int64");
  TORCH_CHECK(!offsets || (offsets->scalar_type() == at::kLong && offsets->is_contiguous()), "offsets: int64");
  LayerWeights w{u16(norms[0]), u16(norms[1]), {}, optional_u16(bq), optional_u16(bk), optional_u16(bv)};
  for (int64_t i = 0; i < MATRICES; ++i) {
    const at::Tensor &data = matrices[2 * i], &scales = matrices[2 * i + 1];
    TORCH_CHECK(data.is_contiguous() && scales.is_contiguous() && formats[i] >= INT4 && formats[i] <= Q4K,
                "decoder_layer: matrix ", i);
    w.matrices[i] = {formats[i], data.data_ptr(), scales.data_ptr(), 0, 0};
  }
  int64_t n = x.size(0), d = x.size(1), kv = keys.size(1);
  auto shape_of = [&](Matrix i, int64_t out, int64_t in) { w.matrices[i].out = out, w.matrices[i].in = in; };
  int64_t ffn = formats[W_GATE] == Q4K ? matrices[2 * W_GATE].size(0) * Q4K_OUTPUTS : matrices[2 * W_GATE].size(0);
  shape_of(WQ, n_heads * hd, d), shape_of(WK, kv * hd, d), shape_of(WV, kv * hd, d), shape_of(WO, d, n_heads * hd);
  shape_of(W_GATE, ffn, d), shape_of(W_UP, ffn, d), shape_of(W_DOWN, d, ffn);
  std::optional<at::Tensor> visible = mask ? std::optional<at::Tensor>(mask->contiguous()) : std::nullopt;
  TORCH_CHECK(!visible || visible->scalar_type() == at::kBool, "mask: bool");
  LayerCache cache{static_cast<uint16_t*>(keys.data_ptr()), static_cast<uint16_t*>(values.data_ptr()),
                   slot_positions.data_ptr<int64_t>(), kv, keys.size(2)};
  LayerPlace at{layer, length, span, offsets ? offsets->data_ptr<int64_t>() : nullptr, positions.data_ptr<int64_t>(),
                u16(cos), u16(sin), visible ? visible->data_ptr<bool>() : nullptr};
  auto out = at::empty({n, d}, x.options());
  decoder_layer_rows(u16(x), n, d, w, cache, at, {n_heads, hd, eps, scale, softcap}, u16(out));
  return out;
}

}  // namespace

TORCH_LIBRARY(lever_avx2, m) {
  lever::define_ops(m, &int4_linear, &int8_linear, &lever::q4k_linear);
  m.def("decoder_layer", &decoder_layer);
}
