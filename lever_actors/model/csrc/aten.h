// The kernels as torch ops: each header's plain function behind a check of its tensors and an
// output tensor, registered once by `define_ops` (every source's attention, RMS norm, rotary
// embedding and q6k product, and the int4, int8 and q4k products it passes in, on tiles or on
// vectors). Built with LEVER_ATEN, so that parallel.h uses torch's thread pool.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "activation.h"
#include "attention.h"
#include "common.h"
#include "integer_rows.h"
#include "norm.h"
#include "q4k.h"
#include "rope.h"

namespace lever {

// a tensor of 16-bit elements (bf16 or float16) as the bits it holds
inline const uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* u16(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// out [m, n] bf16 plus bias [n] bf16 where there is one (common.h, `add_bias`)
inline at::Tensor biased(at::Tensor out, const std::optional<at::Tensor>& bias) {
  if (!bias) return out;
  int64_t rows = out.size(0), n = out.size(1);
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n, "bias: [n] bf16");
  add_bias(u16(out), rows, n, u16(*bias));
  return out;
}

// x [m, k] bf16, the rows a kernel multiplies
inline void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: [m, k] bf16");
}

// x as above; packed [n, k / 2] uint8 in the packing; scales [k / 32, n, 2] bf16 (scale, zero)
inline void check_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  check_rows(x);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: uint8");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(), "scales: bf16");
  int64_t k = x.size(1), n = packed.size(0);
  TORCH_CHECK(n % BLOCK_N == 0 && k % GROUP == 0 && packed.size(1) * 2 == k, "int4 shape");
}

// weight [n, k] int8; scales [n] bf16
inline void check_int8(const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(), "weight: int8");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(), "scales: bf16");
}

// rows x [m, in] bf16 as int8 with a scale per `group` inputs (integer_rows.h)
inline RoundedRows rounded_rows(const at::Tensor& x, int64_t group = GROUP, int64_t k = 0) {
  return rounded_rows(u16(x), x.size(0), x.size(1), group, k);
}

// x [m, k] bf16 times the n rows of w -> [m, n] bf16
template <typename W>
at::Tensor integer_linear(const at::Tensor& x, const W& w, int64_t n) {
  auto out = at::empty({x.size(0), n}, x.options());
  integer_product(u16(x), x.size(0), w, n, u16(out));
  return out;
}

// x [m, k] bf16; data [n, k / 256 * 208] uint8, the Q6_K blocks less d; d [n, k / 256] float16
inline at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& d,
                             const std::optional<at::Tensor>& bias) {
  check_rows(x);
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous(), "data: uint8");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous(), "d: float16");
  int64_t k = x.size(1), n = data.size(0);
  TORCH_CHECK(n % ROWS8 == 0 && k % K_INPUTS == 0, "q6k shape");
  TORCH_CHECK(data.size(1) == k / K_INPUTS * Q6K_BYTES && d.numel() == n * (k / K_INPUTS), "q6k shape");
  Q6KRows w{data.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr()), k};
  return biased(integer_linear(x, w, n), bias);
}

// x [m, in] bf16; records [n / 8, k / 256 * 1152] uint8; ds [n / 8, k / 256 * 16] float16 -> [m, n]
// bf16, where k is `in` rounded up to whole blocks (q4k.h, `q4k_product`)
inline void check_q4k(const at::Tensor& x, const at::Tensor& records, const at::Tensor& ds) {
  check_rows(x);
  TORCH_CHECK(records.scalar_type() == at::kByte && records.is_contiguous(), "records: uint8");
  TORCH_CHECK(ds.scalar_type() == at::kHalf && ds.is_contiguous(), "ds: float16");
  int64_t k = records.size(1) / Q4K_RECORD * K_INPUTS, padding = k - x.size(1);
  TORCH_CHECK(records.size(1) % Q4K_RECORD == 0 && padding >= 0 && padding < K_INPUTS && padding % GROUP == 0, "q4k shape");
  TORCH_CHECK(ds.numel() == records.size(0) * (k / K_INPUTS) * 16, "q4k shape");
}

inline at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& ds,
                             const std::optional<at::Tensor>& bias) {
  check_q4k(x, records, ds);
  int64_t rows = x.size(0), tasks = records.size(0), k = records.size(1) / Q4K_RECORD * K_INPUTS;
  auto out = at::empty({rows, tasks * Q4K_OUTPUTS}, x.options());
  q4k_product(u16(x), rows, x.size(1), records.data_ptr<uint8_t>(), u16(ds), tasks, k, u16(out));
  return biased(out, bias);
}

// x [..., d] bf16 contiguous, weight [d] bf16 -> the same shape (norm.h)
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() >= 1, "x: [..., d] bf16");
  int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == d, "weight: [d] bf16");
  auto out = at::empty(x.sizes(), x.options());
  rms_norm_rows(u16(x), rows, d, u16(weight), eps, u16(out));
  return out;
}

// x [H, n, hd] bf16 with unit stride in hd; cos, sin [n, hd] bf16 -> [H, n, hd] contiguous (rope.h)
inline at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1, "x: [H, n, hd] bf16");
  int64_t H = x.size(0), n = x.size(1), hd = x.size(2);
  TORCH_CHECK(hd % 2 == 0, "rope: head_dim is even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == hd,
                "cos, sin: [n, hd] bf16");
  auto out = at::empty({H, n, hd}, x.options());
  rope_heads(u16(x), H, n, hd, x.stride(0), x.stride(1), u16(cos), u16(sin), u16(out));
  return out;
}

// q [H, n, hd] bf16 contiguous; keys, values [KV, T, hd] bf16, each head's [T, hd] contiguous;
// mask [n, T] bool (True: attend) or none. -> [n, H, hd] bf16
inline at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                         const std::optional<at::Tensor>& mask, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(), "q: [H, n, hd] bf16");
  int64_t H = q.size(0), n = q.size(1), hd = q.size(2), KV = keys.size(0), T = keys.size(1);
  for (const at::Tensor* t : {&keys, &values}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kBFloat16 && t->size(0) == KV && t->size(1) == T &&
                    t->size(2) == hd && t->stride(2) == 1 && t->stride(1) == hd,
                "keys, values: [KV, T, hd] bf16, each head's rows contiguous");
  }
  TORCH_CHECK(T > 0 && hd % 8 == 0 && KV > 0 && H % KV == 0, "attend: shapes");
  TORCH_CHECK(keys.stride(0) == values.stride(0), "keys and values: one head stride");
  const bool* mp = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->size(0) == n && mask->size(1) == T,
                "mask: [n, T] bool");
    mp = mask->data_ptr<bool>();
  }
  TORCH_CHECK(H / KV <= 8, "attend: at most 8 query heads per kv head");
  auto out = at::empty({n, H, hd}, q.options());
  attend_rows(u16(q), H, n, hd, u16(keys), u16(values), KV, T, keys.stride(0), mp, scale, softcap,
              u16(out));
  return out;
}

// positions [n] int64, inv_freq [hd / 2] float32 -> (cos, sin) [n, hd] bf16 (rope.h)
inline std::tuple<at::Tensor, at::Tensor> rope_tables_op(const at::Tensor& positions, const at::Tensor& inv_freq) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1, "positions: [n] int64");
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.dim() == 1, "inv_freq: [hd / 2] float32");
  at::Tensor p = positions.contiguous(), f = inv_freq.contiguous();
  int64_t n = p.size(0), half = f.size(0);
  auto cos = at::empty({n, 2 * half}, p.options().dtype(at::kBFloat16)), sin = at::empty_like(cos);
  rope_tables(p.data_ptr<int64_t>(), n, f.data_ptr<float>(), half, u16(cos), u16(sin));
  return {cos, sin};
}

// gate, up [..., f] bf16 -> bf16(bf16(silu(gate)) * up) (activation.h)
inline at::Tensor swiglu_op(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16 && gate.sizes() == up.sizes(),
              "gate, up: bf16 of one shape");
  at::Tensor g = gate.contiguous(), u = up.contiguous();
  auto out = at::empty(g.sizes(), g.options());
  swiglu(u16(g), u16(u), g.numel(), u16(out));
  return out;
}

template <typename Int4, typename Int8, typename Q4k>
void define_ops(torch::Library& m, Int4* int4, Int8* int8, Q4k* q4k) {
  m.def("attend", &attend);
  m.def("rms_norm", &rms_norm);
  m.def("rope", &rope);
  m.def("swiglu", &swiglu_op);
  m.def("rope_tables", &rope_tables_op);
  m.def("int4_linear", int4);
  m.def("int8_linear", int8);
  m.def("q6k_linear", &q6k_linear);
  m.def("q4k_linear", q4k);
}

}  // namespace lever
