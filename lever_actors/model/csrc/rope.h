// Rotary position embedding for bf16 heads in one call, where torch takes about ten small ops:
// included by both kernels' sources. Each element is rounded as torch's bf16 ops round it, so
// the result is the same bits as model/rope.py's torch code.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#include "common.h"

namespace lever {

// x [H, n, hd] bf16 with unit stride in hd (any other strides: a projection's rows viewed by
// head); cos, sin [n, hd] bf16 contiguous -> [H, n, hd] contiguous:
// bf16(bf16(x * cos) + bf16(rotated * sin)), rotated = (-x[hd/2:], x[:hd/2]) (the HF layout)
inline at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1, "x: [H, n, hd] bf16");
  int64_t H = x.size(0), n = x.size(1), hd = x.size(2), half = hd / 2;
  TORCH_CHECK(hd % 2 == 0, "rope: head_dim is even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == hd,
                "cos, sin: [n, hd] bf16");
  auto out = at::empty({H, n, hd}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  auto rounded = [](float v) { return from_bf16(to_bf16(v)); };
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t* row = xp + h * x.stride(0) + i * x.stride(1);
      const uint16_t *c = cp + i * hd, *s = sp + i * hd;
      uint16_t* o = op + (h * n + i) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        float rotated = d < half ? -from_bf16(row[d + half]) : from_bf16(row[d - half]);
        o[d] = to_bf16(rounded(from_bf16(row[d]) * from_bf16(c[d])) + rounded(rotated * from_bf16(s[d])));
      }
    }
  return out;
}

}  // namespace lever
