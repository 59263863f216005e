// One decoder layer in one call (model/layers.py's `layer_forward`, for the layers model/fused.py
// hands over): the same kernels and ATen ops in the same order, so the same bits, without a
// Python call per op, about 1.3 ms of a one-row draft forward's 10 (Zen 4). Included by the
// AVX2 source, whose products it takes through `Product`.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "aten.h"

namespace lever {

// matrices in this order, each as (data, scales) in `matrices` and a format code in `formats`
enum Matrix { WQ, WK, WV, WO, W_GATE, W_UP, W_DOWN, MATRICES };

// a product of the format `fmt` (model/fused.py's codes): x [n, in] -> [n, out] bf16
using Product = at::Tensor (*)(int64_t fmt, const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                               const std::optional<at::Tensor>& bias);

// x [n, d] bf16 -> the same after the layer. norms: attn_norm, ffn_norm [d] bf16; keys, values
// [L, KV, capacity, hd] and slot_positions [capacity] int64: the KV cache, this layer's k and
// v written at `length` + offsets (or + 0..n-1), which attention then sees up to `length` +
// span; positions [n] int64, cos, sin [n, hd], mask [n, length + span] or none: the placement
template <Product product>
at::Tensor decoder_layer(const at::Tensor& x, at::TensorList norms, at::TensorList matrices, at::IntArrayRef formats,
                         const std::optional<at::Tensor>& bq, const std::optional<at::Tensor>& bk,
                         const std::optional<at::Tensor>& bv, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& slot_positions, int64_t layer, int64_t length, int64_t span,
                         const std::optional<at::Tensor>& offsets, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, const std::optional<at::Tensor>& mask, int64_t n_heads, int64_t hd,
                         double eps, double scale, double softcap) {
  TORCH_CHECK(norms.size() == 2 && matrices.size() == 2 * MATRICES && formats.size() == MATRICES, "decoder_layer: weights");
  auto linear = [&](Matrix m, const at::Tensor& in, const std::optional<at::Tensor>& bias = std::nullopt) {
    return product(formats[m], in, matrices[2 * m], matrices[2 * m + 1], bias);
  };
  int64_t n = x.size(0), n_kv = keys.size(1);
  // attention: q, k, v by head, rotated; k and v into the cache; each row's heads attend
  at::Tensor h = rms_norm(x, norms[0], eps);
  at::Tensor q = rope(linear(WQ, h, bq).view({n, n_heads, hd}).transpose(0, 1), cos, sin);
  at::Tensor k = rope(linear(WK, h, bk).view({n, n_kv, hd}).transpose(0, 1), cos, sin);
  at::Tensor v = linear(WV, h, bv).view({n, n_kv, hd}).transpose(0, 1);
  at::Tensor layer_keys = keys.select(0, layer), layer_values = values.select(0, layer);
  if (offsets.has_value()) {
    at::Tensor slots = *offsets + length;
    layer_keys.index_copy_(1, slots, k);
    layer_values.index_copy_(1, slots, v);
    slot_positions.index_copy_(0, slots, positions);
  } else {
    layer_keys.narrow(1, length, n).copy_(k);
    layer_values.narrow(1, length, n).copy_(v);
    slot_positions.narrow(0, length, n).copy_(positions);
  }
  int64_t seen = length + span;
  at::Tensor attended = attend(q, layer_keys.narrow(1, 0, seen), layer_values.narrow(1, 0, seen),
                               mask.has_value() ? std::optional<at::Tensor>(mask->contiguous()) : std::nullopt, scale,
                               softcap);  // [n, H, hd]
  at::Tensor out = at::add(x, linear(WO, attended.view({n, n_heads * hd})));
  // the gated MLP
  h = rms_norm(out, norms[1], eps);
  at::Tensor gated = at::mul(at::silu(linear(W_GATE, h)), linear(W_UP, h));
  return at::add(out, linear(W_DOWN, gated));
}

}  // namespace lever
