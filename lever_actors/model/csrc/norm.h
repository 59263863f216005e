// RMS norm for bf16 rows, each row on its own in one fixed order: included by both kernels'
// sources. torch's float64 norm is as invariant but costs about ten small ops per call.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"
#include "parallel.h"

namespace lever {

// xp [rows, d] bf16, wp [d] bf16 -> op [rows, d]: weight * bf16(x / sqrt(mean(x^2) + eps)): the
// mean in float64, summed in order; the normed row rounded to bf16 through float32, then times
// the weight in float32 and rounded again, as torch's bf16 product rounds
inline void rms_norm_rows(const uint16_t* xp, int64_t rows, int64_t d, const uint16_t* wp, double eps, uint16_t* op) {
  // a row is a few microseconds: only many rows are worth waking the team for
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
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
}

}  // namespace lever
