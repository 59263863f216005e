// A matrix in any format our vector kernels take, as plain buffers, and its product: what a
// whole layer (layer.h) and the plain library (plain.cpp) multiply by.
#pragma once

#include <cstdint>

#include "common.h"
#include "int4.h"
#include "integer_rows.h"
#include "q4k.h"

namespace lever {

enum Format : int64_t { INT4, INT8, Q6K, Q4K };  // model/formats.py's FORMAT_CODES

struct MatrixRef {
  int64_t fmt;         // a Format
  const void* data;    // model/quantized.py's `data` of the format
  const void* scales;  // and its `scales`
  int64_t out, in;     // the [out, in] shape
};

// x [rows, m.in] bf16 times m (+ bias [m.out] bf16 where not null) -> out [rows, m.out] bf16
inline void product(const MatrixRef& m, const uint16_t* x, int64_t rows, const uint16_t* bias, uint16_t* out) {
  auto bytes = static_cast<const uint8_t*>(m.data);
  auto halves = static_cast<const uint16_t*>(m.scales);
  switch (m.fmt) {
    case INT4: int4_product(x, rows, m.in, bytes, static_cast<const uint32_t*>(m.scales), m.out, out); break;
    case INT8: integer_product(x, rows, Int8Rows{static_cast<const int8_t*>(m.data), halves, m.in}, m.out, out); break;
    case Q6K: integer_product(x, rows, Q6KRows{bytes, halves, m.in}, m.out, out); break;
    case Q4K: {
      int64_t k = (m.in + K_INPUTS - 1) / K_INPUTS * K_INPUTS;  // a last block padded with zeros
      q4k_product(x, rows, m.in, bytes, halves, m.out / Q4K_OUTPUTS, k, out);
      break;
    }
  }
  if (bias) add_bias(out, rows, m.out, bias);
}

}  // namespace lever
