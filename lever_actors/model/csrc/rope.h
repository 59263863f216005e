// Rotary position embedding for bf16 heads in one call, where torch takes about ten small ops:
// included by both kernels' sources. Each element is rounded as torch's bf16 ops round it, so
// the result is the same bits as model/rope.py's torch code.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace lever {

// xp [H, n, hd] bf16 with unit stride in hd and strides (head, row) in elements (any: a
// projection's rows viewed by head); cp, sp [n, hd] bf16 -> op [H, n, hd] contiguous:
// bf16(bf16(x * cos) + bf16(rotated * sin)), rotated = (-x[hd/2:], x[:hd/2]) (the HF layout)
inline void rope_heads(const uint16_t* xp, int64_t H, int64_t n, int64_t hd, int64_t head_stride, int64_t row_stride,
                       const uint16_t* cp, const uint16_t* sp, uint16_t* op) {
  int64_t half = hd / 2;
  auto rounded = [](float v) { return from_bf16(to_bf16(v)); };
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t* row = xp + h * head_stride + i * row_stride;
      const uint16_t *c = cp + i * hd, *s = sp + i * hd;
      uint16_t* o = op + (h * n + i) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        float rotated = d < half ? -from_bf16(row[d + half]) : from_bf16(row[d - half]);
        o[d] = to_bf16(rounded(from_bf16(row[d]) * from_bf16(c[d])) + rounded(rotated * from_bf16(s[d])));
      }
    }
}

// positions [n], inv_freq [hd / 2] float32 -> cos, sin [n, hd] bf16, each half the same: the
// angle a float32 product, as model/rope.py's torch code makes it; its cos and sin in float64
// (the C library's, where torch's float32 ones come from its own vector code), rounded to
// float32 and then to bf16
inline void rope_tables(const int64_t* positions, int64_t n, const float* inv_freq, int64_t half, uint16_t* cos,
                        uint16_t* sin) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < half; ++j) {
      double angle = float(positions[i]) * inv_freq[j];
      uint16_t c = to_bf16(float(std::cos(angle))), s = to_bf16(float(std::sin(angle)));
      cos[i * 2 * half + j] = cos[i * 2 * half + half + j] = c;
      sin[i * 2 * half + j] = sin[i * 2 * half + half + j] = s;
    }
}

}  // namespace lever
