// RMS norm for bf16 rows, each row on its own in one fixed order: included by both kernels'
// sources. torch's float64 norm is as invariant but costs about ten small ops per call.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>

#include "common.h"

namespace lever {

// x [..., d] bf16 contiguous, weight [d] bf16 -> weight * bf16(x / sqrt(mean(x^2) + eps)): the
// mean in float64, summed in order; the normed row rounded to bf16 through float32, then times
// the weight in float32 and rounded again, as torch's bf16 product rounds
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() >= 1, "x: [..., d] bf16");
  int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == d, "weight: [d] bf16");
  auto out = at::empty(x.sizes(), x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  // a row is a few microseconds: only many rows are worth waking the team for
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * d;
      double squares = 0.0;
      for (int64_t i = 0; i < d; ++i) {
        double v = from_bf16(row[i]);
        squares += v * v;
      }
      double inverse = 1.0 / std::sqrt(squares / double(d) + eps);
      for (int64_t i = 0; i < d; ++i) {
        float normed = from_bf16(to_bf16(float(double(from_bf16(row[i])) * inverse)));
        op[r * d + i] = to_bf16(from_bf16(wp[i]) * normed);
      }
    }
  });
  return out;
}

}  // namespace lever
